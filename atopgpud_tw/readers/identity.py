"""How devices are named on the wire: one scheme for every reader (docs/mig.md).

atop keeps only the last 12 characters of a bus id and of a type name, so a MIG
instance is told apart within them: bus id ``00000000:17:00.0/1.0`` (the card's,
``/``, the driver's GPU and compute instance ids), type ``3g.40gb`` (the profile,
as ``nvidia-smi -L`` lists it), key ``UUID/1.0`` (internal, across polls).

A card's key is its UUID (its bus id where it has none).  Some hosts show two
cards with one UUID (anonymised reports, cloned VMs): `CardKeys` keys the second
``UUID@BUSID``, so that both are shown and counted.
"""

from __future__ import annotations

from typing import Sequence


def mig_key(card: str, gpu_instance: int, compute_instance: int) -> str:
    """A MIG instance's identity across polls from its card's key, and its bus id from the card's."""
    return f"{card}/{gpu_instance}.{compute_instance}"


mig_busid = mig_key


def mig_ids(card_key: str, key: str) -> int | None:
    """The GPU instance id of the MIG instance of `card_key` whose key is `key`; None for any other key."""
    gpu_instance, _, compute_instance = key.removeprefix(f"{card_key}/").partition(".")
    if not key.startswith(f"{card_key}/") or not (gpu_instance.isdigit() and compute_instance.isdigit()):
        return None
    return int(gpu_instance)


def mig_profile(name: str) -> str:
    """The profile of a MIG device from its name (``NVIDIA A100 ... MIG 3g.20gb``, or the profile already)."""
    return name.rsplit(" MIG ", 1)[-1].removeprefix("MIG ").strip()


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
