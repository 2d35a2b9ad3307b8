"""Tests of the SGLang plugin (node_agent/integrations/sglang)."""
