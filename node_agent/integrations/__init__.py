"""Engine adapters: one leaf subpackage per inference engine.

Each subpackage is the only code that imports its engine, and imports it lazily,
so ``import node_agent.integrations.<engine>`` works without the engine
installed. ``node_agent`` itself never imports an engine.
"""
