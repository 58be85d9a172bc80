"""GPU Performance Monitoring (GPM): what the GPU really did, on Hopper and later (docs/mig.md, docs/fidelity.md).

The driver works a GPM metric out from two samples of the hardware's counters, as the exact
average between them: one sample per source (a card, or a GPU instance of a card in MIG mode)
per poll, into two buffers that swap.  A GPM call that fails fails GPM alone, for that source
and poll; the previous sample is kept, so the next figures cover both polls.  GPM's graphics
activity is the busy figure atop gets (`TASK_BUSY_GPM` in the task-support digit).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cache
from typing import Any, Callable

from twisted.logger import Logger

from atopgpud_tw.nvml_codes import NOT_SUPPORTED, SUCCESS
from atopgpud_tw.problems import Problems, printable
from atopgpud_tw.readers.identity import mig_ids
from atopgpud_tw.readers.nvml.calls import Attempt, Failed, NvmlSession, Outcome, Unsupported, answer
from atopgpud_tw.readers.nvml.device import NvmlDevice
from atopgpud_tw.snapshot import TASK_BUSY_GPM, UNSUPPORTED, DeviceSample, GpmFigures, clamp_percent

log = Logger(namespace="atopgpud_tw.readers.nvml_gpm")


@cache
def metrics() -> tuple[tuple[str, int, bool], ...]:
    """The figures read: (name, NVML_GPM_METRIC_* id, a rate in MiB/s rather than a percentage),
    from the table's GPM rows, loaded at the first card that has GPM."""
    from atopgpud_tw.figures import GPM_FIGURES

    return tuple((f.gpm.name, f.gpm.metric, f.gpm.rate) for f in GPM_FIGURES if f.gpm is not None)


#: seconds: samples closer than this give no figures (the NVML reference: more than 100 ms)
MIN_SPAN = 0.1
#: `GpmReader._take` instead of figures: none yet (the busy figure fails) and none at all (-1)
PENDING = "pending"
NO_GPM = "no gpm"
#: whether a whole card's busy figure is GPM's graphics activity where it has GPM (docs/fidelity.md,
#: "Which figure feeds atop's busy counter"); bench/fidelity.py turns it off
WHOLE_CARD_BUSY_FROM_GPM = True


@dataclass(eq=False)
class GpmStream:
    """One source's sample buffers: the previous poll's sample (taken at `at`) and a spare."""

    previous: Any = None
    at: float = 0.0
    spare: Any = None
    #: the figures of the last poll that had some, which stand for a poll too soon after it
    last: GpmFigures | None = None


@dataclass(eq=False)
class CardGpm:
    """What is known of one card's GPM."""

    #: None until nvmlGpmQueryDeviceSupport has answered
    supported: bool | None = None
    #: whether the card was in MIG mode when its streams were made
    mig: bool = False
    card: GpmStream = field(default_factory=GpmStream)
    #: by GPU instance id
    instances: dict[int, GpmStream] = field(default_factory=dict)

    def streams(self) -> list[GpmStream]:
        return [self.card, *self.instances.values()]


class GpmReader:
    """The GPM of every card of one reader (all of it runs in the reader's worker thread)."""

    def __init__(self, session: NvmlSession, clock: Callable[[], float] | None = None) -> None:
        self.session = session
        #: the time of a sample, read when it is taken (None: the poll's time)
        self._clock = clock
        self._cards: dict[str, CardGpm] = {}
        #: the binding's metrics request, made once and reused (it holds NVML_GPM_METRIC_MAX entries)
        self._request: Any = None

    def layout(self, card: NvmlDevice, samples: list[DeviceSample], mig: str = "instances") -> list[DeviceSample]:
        """A card's devices as ``T`` shows them from the start, GPM's busy figure in their digit."""
        enabled = card.mig_state.enabled
        if not (enabled or WHOLE_CARD_BUSY_FROM_GPM) or not self._supported(card, Problems()):
            return samples
        if enabled and mig == "instances":
            return [_busy_flag(s) if mig_ids(card.key, s.key) is not None else s for s in samples]
        return [_busy_flag(s) if s.key == card.key else s for s in samples]

    def read(
        self, card: NvmlDevice, samples: list[DeviceSample], problems: Problems, now: float, mig: str = "instances"
    ) -> list[DeviceSample]:
        """A card's samples of this poll, with what GPM measured since the last poll."""
        if not self._supported(card, problems):
            return samples
        state = self._cards[card.key]
        enabled = card.mig_state.enabled
        if enabled != state.mig:
            self._free(card, state.streams())
            state.card, state.instances, state.mig = GpmStream(), {}, enabled
        if not enabled or mig == "card":
            figures = self._take(card, state.card, None, problems, now)
            if enabled:
                return [_with(s, figures) if s.key == card.key and s.present else s for s in samples]
            return [_whole(s, figures) if s.key == card.key and s.present else s for s in samples]
        present = {gi for gi in (mig_ids(card.key, key) for key in card.mig_state.instances) if gi is not None}
        gone = [gi for gi in state.instances if gi not in present]
        self._free(card, [state.instances.pop(gi) for gi in gone])
        taken: dict[int, GpmFigures | str] = {}
        out = []
        for sample in samples:
            gi = mig_ids(card.key, sample.key)
            if gi is None or not sample.present:
                out.append(sample)
                continue
            if gi not in taken:
                stream = state.instances.setdefault(gi, GpmStream())
                taken[gi] = self._take(card, stream, gi, problems, now)
            out.append(_with(sample, taken[gi]))
        return out

    def forget(self, key: str) -> None:
        """A card is lost: its buffers are freed (a card found again starts afresh)."""
        state = self._cards.pop(key, None)
        if state is not None:
            self._free(None, state.streams())

    def keep(self, keys: set[str]) -> None:
        """Only the cards of these keys are read now: any other's buffers are freed (all of
        them for none, before NVML is shut down: buffers do not outlive it)."""
        if self._cards.keys() <= keys:
            return  # every poll but one after a card went: nothing to free
        for key in [key for key in self._cards if key not in keys]:
            self.forget(key)

    def _supported(self, card: NvmlDevice, problems: Problems) -> bool:
        state = self._cards.setdefault(card.key, CardGpm())
        if state.supported is None:
            # not supported, or nothing there: no GPM; a failure: asked again at the next poll
            answer = Attempt(card, problems)(
                lambda: card.call("nvmlGpmQueryDeviceSupport"), unsupported=False, idle=False, key="gpm support"
            )
            if answer is None:
                return False
            state.supported = answer is not False and bool(int(getattr(answer, "isSupportedDevice", 0)))
            if state.supported:
                card.session.say_once(
                    f"gpm {card.key}",
                    "nvml: GPU {busid} has GPU Performance Monitoring (GPM): SM, tensor, DRAM, PCIe and NVLink "
                    "activity, and busy figures for its MIG instances",
                    busid=printable(card.busid),
                )
        return bool(state.supported)

    def _take(
        self, card: NvmlDevice, stream: GpmStream, gpu_instance: int | None, problems: Problems, now: float
    ) -> GpmFigures | str:
        """This poll's figures of one source, or `PENDING` or `NO_GPM`."""
        where = f"GPU {card.busid}" if gpu_instance is None else f"GPU {card.busid} GPU instance {gpu_instance}"
        attempt = Attempt(card, problems, subject=where)
        found = answer(self._sample, card, stream, gpu_instance, now)
        if isinstance(found, Unsupported):
            attempt.note(f"{found}: not supported", key=f"gpm {gpu_instance}")
            return NO_GPM
        if isinstance(found, Failed) and found.value == NOT_SUPPORTED:
            # GPM did not measure while it said so: its next figures start afresh (after
            # other failures they reach back: its counters ran on)
            self._free(card, [stream])
        # NOT_FOUND: a GPU instance destroyed since it was listed (the next poll drops it)
        taken = attempt.answered(found, idle=PENDING, part=(f"gpm {gpu_instance}", "GPM"))
        return PENDING if taken is None else taken

    def _sample(self, card: NvmlDevice, stream: GpmStream, gpu_instance: int | None, now: float) -> GpmFigures | str:
        if stream.spare is None:
            stream.spare = self.session.call("nvmlGpmSampleAlloc", where=card.where)
        if gpu_instance is None:
            card.call("nvmlGpmSampleGet", stream.spare)
        else:
            card.call("nvmlGpmMigSampleGet", gpu_instance, stream.spare)
        at = now if self._clock is None else self._clock()
        figures: GpmFigures | str = PENDING
        if stream.previous is not None:
            if at - stream.at < MIN_SPAN:
                # too soon for figures of their own: the last ones stand, over no time (counted once)
                return PENDING if stream.last is None else replace(stream.last, seconds=0.0)
            figures = stream.last = self._metrics(card, stream.previous, stream.spare, at - stream.at)
        stream.previous, stream.spare, stream.at = stream.spare, stream.previous, at
        return figures

    def _metrics(self, card: NvmlDevice, first: Any, second: Any, seconds: float) -> GpmFigures:
        request = self._request
        asked = metrics()
        if request is None:
            request = self._request = self.session.nvml.c_nvmlGpmMetricsGet_t()
            request.version = self.session.nvml.NVML_GPM_METRICS_GET_VERSION
            request.numMetrics = len(asked)
            for index, (_, metric, _) in enumerate(asked):
                request.metrics[index].metricId = metric
        request.sample1, request.sample2 = first, second
        self.session.call("nvmlGpmMetricsGet", request, where=card.where)
        values = []
        for index, (name, _, _) in enumerate(asked):
            entry = request.metrics[index]
            if int(entry.nvmlReturn) == SUCCESS:
                values.append((name, max(0.0, float(entry.value))))
        return GpmFigures(seconds, tuple(values))

    def _free(self, card: NvmlDevice | None, streams: list[GpmStream]) -> None:
        where = None if card is None else card.where
        for stream in streams:
            for buffer in (stream.previous, stream.spare):
                # (failing: a buffer of a library shut down beneath us: nothing more to give back)
                if buffer is not None:
                    answer(self.session.call, "nvmlGpmSampleFree", buffer, where=where, catch=Outcome)
            stream.previous = stream.spare = None


def _busy_flag(sample: DeviceSample) -> DeviceSample:
    return replace(sample, task_support=sample.task_support | TASK_BUSY_GPM)


def _whole(sample: DeviceSample, taken: GpmFigures | str) -> DeviceSample:
    """A whole card's sample with GPM's figures; with `WHOLE_CARD_BUSY_FROM_GPM`, its busy figure
    GPM's graphics activity where this poll has it, else the sample buffer's."""
    figures = taken if isinstance(taken, GpmFigures) else None
    if not WHOLE_CARD_BUSY_FROM_GPM:
        return sample if figures is None else replace(sample, gpm=figures)
    graphics = None if figures is None else figures.get("graphics")
    busy = sample.gpu_busy if graphics is None else clamp_percent(graphics)
    return replace(sample, gpm=figures, gpu_busy=busy, task_support=sample.task_support | TASK_BUSY_GPM)


def _with(sample: DeviceSample, taken: GpmFigures | str) -> DeviceSample:
    """A MIG device's sample with GPM's figures, its busy figure GPM's graphics activity: None
    in a poll without figures (the first sample, a failed one: the next poll's figures reach
    back), -1 where the source cannot be sampled at all."""
    figures = taken if isinstance(taken, GpmFigures) else None
    graphics = None if figures is None else figures.get("graphics")
    gpu_busy = UNSUPPORTED if figures is not None or taken == NO_GPM else None
    if graphics is not None:
        gpu_busy = clamp_percent(graphics)
    return replace(sample, gpm=figures, gpu_busy=gpu_busy, task_support=sample.task_support | TASK_BUSY_GPM)
