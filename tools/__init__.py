"""What stands on the core, for bench.py: its setup, generation runs and tables, and the metrics on code."""
