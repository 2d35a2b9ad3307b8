# Two entry points a new user needs; everything else lives in scripts/.
.PHONY: demo test lint bench image-test

demo:  ## Run the embedded demo: agents, a PP group, a synthetic engine workload
	bash scripts/demo.sh

test:  ## Install everything into .venv, lint, type-check, run the test suite
	bash scripts/test.sh

image-test:  ## Build the operator and agent images with buildah and run them (root, Debian)
	bash scripts/image_test.sh

lint:
	bash scripts/test.sh --lint-only

bench:
	bash scripts/bench.sh
