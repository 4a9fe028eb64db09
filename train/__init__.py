"""The worker commands users type (`python -m train`, `train.evaluate`, `train.doctor`, ...); the code is torchlaunch."""
