"""Engine adapters: one leaf subpackage per engine, the only code that imports it."""
