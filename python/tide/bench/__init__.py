"""tide-bench: stock FSDP2 vs TIDE side by side. Run ``tide-bench --help``."""
