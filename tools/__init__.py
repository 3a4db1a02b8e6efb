"""What a maintainer keeps beside the package: the GPU run script (device_run.sh), the
compute-sanitizer driver (device_sanitize.sh, sanitize_driver.py), the memory-growth check
(memory_growth.py) and the main job on a GPU (device_check.sh). Importable from the repository's
root (``python -m pytest`` puts it on the path), so the tests import the driver as a module."""
