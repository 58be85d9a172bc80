"""The nvidia-smi reader: ``nvidia-smi -q -x`` run as a child process each poll (reader.py)."""
