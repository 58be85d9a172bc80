"""The NVML reader: the real pynvml binding, called in one daemon thread (`reader.NvmlReader`).

Each call goes through one choke point (`device`, `calls`) into what it means (`calls.Attempt`).
"""
