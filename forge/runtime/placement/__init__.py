"""Placement: a device group's `device_map` planned by the memory model (`device_map.py`, `stages.py`),
applied by accelerate (`dispatch.py`), the group as the packer sees it (`group_device.py`), and
whether the devices a run names exist (`device_check.py`)."""
