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

A card's key is its UUID (its bus id where it has none).  Some hosts show two
cards with one UUID (anonymised reports, VMs cloned from one image): `CardKeys`
then keys the second by UUID and bus id, ``GPU-...@00000000:65:00.0``, so that
both are shown and counted, and keeps every key it gave to the same card at
later polls, whichever of the two is missing then.
"""

from __future__ import annotations

from typing import Sequence

MIG_SEPARATOR = " MIG "


def mig_key(card: str, gpu_instance: int, compute_instance: int) -> str:
    """A MIG instance's identity across polls from its card's key, and its bus id from the card's."""
    return f"{card}/{gpu_instance}.{compute_instance}"


mig_busid = mig_key


def mig_ids(card_key: str, key: str) -> int | None:
    """The GPU instance id of the MIG instance of `card_key` whose key is `key` (`mig_key`);
    None for any other key."""
    gpu_instance, _, compute_instance = key.removeprefix(f"{card_key}/").partition(".")
    if not key.startswith(f"{card_key}/") or not (gpu_instance.isdigit() and compute_instance.isdigit()):
        return None
    return int(gpu_instance)


def mig_profile(name: str) -> str:
    """The profile of a MIG device from its name (``NVIDIA A100 ... MIG 3g.20gb``); a name without
    the MIG marker is taken to be the profile already."""
    return name.rsplit(MIG_SEPARATOR, 1)[-1].removeprefix("MIG ").strip()


class CardKeys:
    """Keys for the cards of each poll: unique within it, the same for a card across polls."""

    def __init__(self) -> None:
        #: the key given to each (UUID or None, bus id) seen
        self._given: dict[tuple[str | None, str], str] = {}

    def assign(self, cards: Sequence[tuple[str | None, str]]) -> list[str]:
        """The keys of `cards`, each (its UUID or None, its bus id), in their order: a card seen before
        keeps its key; a new one gets its UUID (else its bus id), or its UUID and bus id where another
        card of this poll has that already."""
        keys: list[str | None] = [None] * len(cards)
        taken: set[str] = set()
        for position, card in enumerate(cards):
            given = self._given.get(card)
            if given is not None and given not in taken:
                keys[position] = given
                taken.add(given)
        for position, (uuid, busid) in enumerate(cards):
            if keys[position] is not None:
                continue
            key = uuid or busid
            if key in taken:
                key = f"{key}@{busid}"
            while key in taken:  # the same bus id twice as well: a report gone wrong
                key += "+"
            keys[position] = key
            taken.add(key)
            self._given[(uuid, busid)] = key
        return [key for key in keys if key is not None]
