"""The one table of the troubles a reader reports (`problems.Problems`), each with its cause and what to do.

docs/operations.md's list of problem lines is written from it (docs/make_operations.py),
and tests/test_operations.py checks that each place that reports a trouble names a kind here.
"""

from __future__ import annotations

from typing import NamedTuple


class Kind(NamedTuple):
    """One kind of trouble: its anchor in docs/operations.md, the reader whose lines carry it, the
    line after ``<reader>: `` (``<...>``: what varies), its cause, and the action to take."""

    name: str
    reader: str
    line: str
    cause: str
    action: str


KINDS: tuple[Kind, ...] = (
    Kind(
        "nvml-init", "nvml", "cannot set up NVML (<why>)",
        "Setting NVML up again failed for a reason other than the driver's coming and going (which "
        "has its own line, below the list): `<why>` names it, such as no permission to use the GPUs, "
        "or an NVML error. atop shows no GPU meanwhile.",
        "Run `nvidia-smi` as the daemon's user: it fails the same way. For a permission, check the "
        "mode and group of `/dev/nvidia*`. The daemon tries again on its own, at growing intervals, "
        "and logs `recovered` when it can.",
    ),
    Kind(
        "nvml-reinit", "nvml", "NVML is being set up again",
        "NVML is not set up, or no GPU is left to read, and the daemon is waiting for its next try "
        "to set it up and look for GPUs again (its tries back off to once a minute).",
        "Nothing if it recovers; if it lasts, see the `nvml` lines logged just before it (a lost GPU, "
        "the driver gone) and `nvidia-smi`.",
    ),
    Kind(
        "gpu-lost", "nvml", "GPU <bus id>: <call>: NVML_ERROR_GPU_IS_LOST",
        "The GPU stopped answering: fallen off the bus, reset, or unbound. Its figures read absent; the "
        "daemon looks for it again at each re-discovery.",
        "Look in the kernel log (`journalctl -k | grep -i xid`; XID 79 is a GPU fallen off the bus) and "
        "at `nvidia-smi`. A GPU that does not come back needs a reset (`nvidia-smi -r`) or a reboot.",
    ),
    Kind(
        "mig-instance-lost", "nvml", "MIG instance <id>: <cause>",
        "A MIG instance was lost while it was read: destroyed, or its card reconfigured.",
        "Nothing if the instance was destroyed on purpose; otherwise see `nvidia-smi mig -lgi`.",
    ),
    Kind(
        "index-unusable", "nvml", "GPU index <n> cannot be used: <cause>; looking for it again",
        "A device NVML counts could not be opened at discovery (no permission on its `/dev/nvidia<n>`, "
        "a GPU that needs a reset, one being set up).",
        "Run `nvidia-smi -i <n>`; check the permissions of `/dev/nvidia<n>` for the daemon's user. "
        "The daemon keeps looking for it and logs `recovered` when it joins.",
    ),
    Kind(
        "nvml-call", "nvml", "GPU <bus id>: <call>: <NVML error>",
        "One NVML call failed with the error named (also `NVML_ERROR_NOT_FOUND` where a value was "
        "expected, or a call that had answered and is now refused). The figure it gives is left out "
        "of this poll, not shown as 0; the other figures are kept.",
        "One that recovers within a poll or two: nothing. One that stays: look the error up in NVIDIA's "
        "NVML reference and in the kernel log; `NVML_ERROR_UNKNOWN` on every call often means a driver "
        "in trouble, and `/-/ready` says so once no GPU can be read.",
    ),
    Kind(
        "mig-slot", "nvml", "GPU <bus id>: MIG device <slot>: <NVML error>",
        "Reading which MIG instance sits at a slot of a card in MIG mode failed; that instance is left "
        "out of the poll.",
        "As for a failed NVML call: nothing if it passes; otherwise see `nvidia-smi mig -lgi` and the kernel log.",
    ),
    Kind(
        "mig-identity", "nvml", "GPU <bus id>: MIG device <slot> left out: <call> is not supported",
        "The driver cannot say which GPU and compute instance a MIG device is; the daemon does not "
        "guess, and leaves it out.",
        "Upgrade the driver to one that supports MIG fully for this card.",
    ),
    Kind(
        "mig-empty", "nvml and nvidia-smi", "GPU <bus id> is in MIG mode with no instances: nothing can run on it",
        "MIG mode is on but no GPU instance exists: the card can run nothing.",
        "Create instances (`nvidia-smi mig -cgi <profiles> -C`) or turn MIG mode off (`nvidia-smi -i <n> -mig 0`).",
    ),
    Kind(
        "gpm-unsupported", "nvml", "GPU <bus id>[ GPU instance <n>]: <call>: not supported",
        "The GPM counters (SM occupancy, tensor and memory bandwidth) are not available there: a card "
        "before Hopper, or a MIG instance the driver gives none for.",
        "Nothing: the GPM figures are left out for that device.",
    ),
    Kind(
        "health-lost", "health", "GPU <bus id>: <cause>",
        "Reading a card's health figures for `--metrics` was cut short: the card was lost, or NVML is "
        "being set up again. The health series of that card are left out until it can be read.",
        "As for a lost GPU or a driver set up again: see those lines, logged by `nvml` at the same time.",
    ),
    Kind(
        "smi-preamble", "nvidia-smi", "nvidia-smi printed before its report: <text>",
        "nvidia-smi wrote something before its XML report, most often a driver warning (a library and "
        "kernel module mismatch, a GPU that needs a reset).",
        "Read the text: it is nvidia-smi's own. Run `nvidia-smi -q -x | head` as the daemon's user.",
    ),
    Kind(
        "smi-mig-names", "nvidia-smi", "MIG profile names unknown, names derived from the report shown (<error>)",
        "`nvidia-smi -L`, which names the MIG profiles, failed; the instances are named from the "
        "report's own figures instead. It is tried again later.",
        "Run `nvidia-smi -L` as the daemon's user and see what it says.",
    ),
    Kind(
        "smi-no-id", "nvidia-smi", "GPU number <n> in the report has no bus id and no UUID",
        "A GPU of nvidia-smi's report names neither; it cannot be told apart from the next poll's, and "
        "is left out.",
        "Check `nvidia-smi -q -x` by hand; an old or broken nvidia-smi is the likely cause.",
    ),
    Kind(
        "smi-value", "nvidia-smi", "GPU <id>: unreadable <element> '<text>' (or implausible ...)",
        "A figure of nvidia-smi's report is not a number the daemon can read, or cannot be true (used "
        "memory above the total). That figure is left out of the poll.",
        "Compare with `nvidia-smi -q -x`; a new nvidia-smi may write a unit or a word the daemon does "
        "not know yet: report it with that output.",
    ),
    Kind(
        "smi-long", "nvidia-smi", "GPU <id>: <<element>> is longer than <n> characters (<size>): ...",
        "A text of the report is longer than the daemon keeps; its start and end are kept.",
        "Nothing; it is said once so that an odd report is seen.",
    ),
    Kind(
        "smi-processes", "nvidia-smi", "GPU <bus id> lists <n>: none of them is counted",
        "A card lists more processes than the parser keeps in one report; none of that card's "
        "processes is counted in this poll, rather than a part of them.",
        "Nothing to fix in the daemon; per-process figures of that card are missing while it lasts.",
    ),
    Kind(
        "smi-pid", "nvidia-smi", "GPU <bus id>: unreadable pid '<text>'",
        "A process of the report has a pid that is not a number; the card's process list is left out "
        "of this poll, so that no process seems to end.",
        "Compare with `nvidia-smi -q -x`; report it with that output.",
    ),
    Kind(
        "smi-mig-ids", "nvidia-smi", "GPU <bus id>: a MIG device without ids is left out",
        "A MIG device of the report has no index, GPU instance or compute instance id.",
        "Check `nvidia-smi -q -x`; often a MIG reconfiguration under way, gone by the next poll.",
    ),
    Kind(
        "smi-mig-unmatched", "nvidia-smi",
        "GPU <bus id>: processes on no listed MIG instance are left out (pids [...])",
        "Processes are listed on GPU and compute instance ids that no MIG device of the report has, "
        "often while instances are being made or destroyed.",
        "Nothing if it passes; otherwise compare `nvidia-smi -q -x` with `nvidia-smi mig -lci`.",
    ),
)
