"""How devices are named on the wire: one scheme for every reader (docs/mig.md).

atop keeps only the last 12 characters of a bus id and of a type name, so a MIG
instance must be told apart within them:

- bus id: the card's bus id, ``/``, the GPU instance id, ``.``, the compute
  instance id: ``00000000:17:00.0/1.0``; atop shows ``:17:00.0/1.0`` (bus 17, GPU
  instance 1, compute instance 0).  The ids are the driver's; they stay the same
  for the same carving across polls and restarts.
- type: the MIG profile, ``3g.40gb`` (``1c.3g.40gb`` for a compute instance smaller
  than its GPU instance), as NVML names the MIG device (``... MIG 3g.40gb``) and as
  ``nvidia-smi -L`` lists it.
- key (internal identity across polls): the card's UUID, ``/``, ``gi.ci``.
"""

from __future__ import annotations

MIG_SEPARATOR = " MIG "


def mig_busid(card_busid: str, gpu_instance: int, compute_instance: int) -> str:
    """The bus id shown for a MIG instance."""
    return f"{card_busid}/{gpu_instance}.{compute_instance}"


def mig_key(card_key: str, gpu_instance: int, compute_instance: int) -> str:
    """The identity of a MIG instance across polls."""
    return f"{card_key}/{gpu_instance}.{compute_instance}"


def mig_profile(name: str) -> str:
    """The profile of a MIG device from its name (``NVIDIA A100 ... MIG 3g.20gb``).

    A name without the MIG marker is taken to be the profile already.
    """
    if MIG_SEPARATOR in name:
        return name.rsplit(MIG_SEPARATOR, 1)[1].strip()
    if name.startswith("MIG "):
        return name[4:].strip()
    return name.strip()
