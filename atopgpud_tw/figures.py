"""The table of figures: every health, power and GPM figure of a card as one row (`Figure`), whence the page,
both readers, the client and the simulator take their part; data only, importing nothing of the package
(docs/design.md, "The table of figures"; adding a figure of a known shape is one row, "Extending")."""

from __future__ import annotations

from dataclasses import dataclass

Number = float | int
#: the label values of a series (a series: its metric name and these, `Figure.series`)
Labels = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Family:
    """A series of the page: its name (a counter's with ``_total``), type, help, and label names
    beyond the card's (busid, type, uuid)."""

    name: str
    kind: str
    help: str
    labels: tuple[str, ...] = ()


@dataclass(frozen=True)
class Ask:
    """How the NVML reader asks for a figure: ``nvml.<function>(handle, *args)``, times `scale`;
    rows with the same call (function, args, variant, field) share one call per reading."""

    function: str
    args: tuple[int, ...] = ()
    scale: float = 1.0
    #: what is remembered as unsupported when it is not the function itself (one function, several figures)
    variant: str | None = None
    #: a field id of ``nvmlDeviceGetFieldValues`` (its entry has a return code of its own)
    field: int | None = None
    #: the element of the answer: an index of a list, or an attribute of a structure
    pick: int | str | None = None
    #: a bit of a mask: the figure is 1 while it is set
    bit: int | None = None
    #: a yes/no answer: 1 or 0
    flag: bool = False
    #: answers from here up mean "unknown": no series
    below: float | None = None
    #: the function's older names, asked where the binding or the driver lacks it
    older: tuple[str, ...] = ()
    #: asked once per active NVLink (link first among the arguments), with the label ``link``
    per_link: bool = False


@dataclass(frozen=True)
class Smi:
    """Where ``nvidia-smi -q -x`` has a figure, under a ``<gpu>``: the first path present is read."""

    #: newest schema first
    paths: tuple[str, ...]
    scale: float = 1.0
    #: the most a GPU can plausibly report (in the series' unit); beyond it the report is garbled
    most: float | None = None
    #: "number" (with a unit: "45 C", "16x", "509 KB/s"), "yes_no", "active", "pstate" ("P2")
    parse: str = "number"
    #: where no path is present: the sum of these parts (each a list of "a+b" alternatives, first present)
    parts: tuple[tuple[str, ...], ...] = ()


@dataclass(frozen=True)
class Show:
    """Where ``atopgpu --health`` shows a figure: a JSON key (a path into the card's object), the
    series' value divided by `per`; and a column of the table, if it has one."""

    key: tuple[str, ...]
    per: float = 1.0
    column: str | None = None
    unit: str = ""
    decimals: int = 0
    #: the column's value is the JSON value divided by this
    column_per: float = 1.0
    prefix: str = ""


@dataclass(frozen=True)
class Play:
    """The simulator's field of a scenario GPU's ``health`` object: its default (None: not
    supported), its bounds, and NVML's units per unit of the field (1000: watts played, mW answered)."""

    field: str
    default: Number | None
    low: float = 0
    high: float | None = None
    per: float = 1.0
    #: a GPM figure's field: the activity it is a share of ("gpu": graphics, "mem": memory), or
    #: (a figure in MiB/s) the activity during which it moves the field's MiB per second
    follows: str = "gpu"


#: the units of a GPM figure: a percentage (summed as percent-seconds), or MiB per second (summed as bytes)
PERCENT = "percent"
MIB_PER_SECOND = "MiB/s"
MIB = 1048576


@dataclass(frozen=True)
class Gpm:
    """How the NVML reader reads a figure from GPU Performance Monitoring, once per poll: one metric
    of ``nvmlGpmMetricsGet`` between the poll's sample and the one before (readers/nvml/gpm.py)."""

    #: the figure's name in each poll's `GpmFigures` and in `GpmTotals.sums`
    name: str
    #: NVML_GPM_METRIC_* of nvml.h
    metric: int
    #: `PERCENT` or `MIB_PER_SECOND`
    unit: str = PERCENT

    @property
    def rate(self) -> bool:
        """In MiB/s (summed as bytes), not a percentage."""
        return self.unit == MIB_PER_SECOND


@dataclass(frozen=True)
class Figure:
    """One figure: one series with its label values, and how each reader and user finds it."""

    family: Family
    labels: Labels = ()
    nvml: Ask | None = None
    smi: Smi | None = None
    show: Show | None = None
    play: Play | None = None
    #: a GPM figure's metric (the rows of `GPM_FIGURES`; None for every other)
    gpm: Gpm | None = None

    @property
    def series(self) -> tuple[str, Labels]:
        return self.family.name, self.labels


TEMPERATURE = Family("atopgpud_gpu_temperature_celsius", "gauge", "GPU temperature.")
MEMORY_TEMPERATURE = Family("atopgpud_gpu_memory_temperature_celsius", "gauge", "GPU memory (HBM) temperature.")
POWER = Family("atopgpud_gpu_power_watts", "gauge", "Power drawn by the GPU now.")
POWER_LIMIT = Family("atopgpud_gpu_power_limit_watts", "gauge", "The power limit the driver enforces.")
ENERGY = Family("atopgpud_gpu_energy_joules_total", "counter", "Energy the GPU used since the driver was loaded.")
CLOCK = Family("atopgpud_gpu_clock_hertz", "gauge", "Current clock frequency, by clock domain.", ("clock",))
CLOCKS_EVENT = Family("atopgpud_gpu_clocks_event_active", "gauge",
                      "1 while this reason holds the clocks down (throttling).", ("reason",))
PSTATE = Family("atopgpud_gpu_performance_state", "gauge", "Performance state (0 = P0, the highest, to 15).")
FAN = Family("atopgpud_gpu_fan_speed_percent", "gauge", "Fan speed as a percentage of its maximum.")
ECC = Family("atopgpud_gpu_ecc_errors_total", "counter", "ECC errors, by kind and by counter (volatile: since the "
             "driver was loaded; aggregate: the GPU's lifetime).", ("error", "counter"))
REMAPPED = Family("atopgpud_gpu_remapped_rows", "gauge", "Memory rows remapped, by the kind of error that caused it.",
                  ("cause",))
REMAP_PENDING = Family("atopgpud_gpu_row_remap_pending", "gauge", "1 if a row remapping waits for a GPU reset.")
REMAP_FAILED = Family("atopgpud_gpu_row_remap_failed", "gauge", "1 if a row remapping failed.")
PCIE_REPLAYS = Family("atopgpud_gpu_pcie_replays_total", "counter", "PCIe replays (retransmissions) of the GPU's link.")
CLOCKS_EVENT_TIME = Family("atopgpud_gpu_clocks_event_seconds_total", "counter",
                           "Time this reason held the clocks down, as the driver counts it (exact whatever the "
                           "scrape interval).", ("reason",))
VIOLATION_TIME = Family("atopgpud_gpu_violation_seconds_total", "counter",
                        "Time the clocks were held below their target by this performance policy.", ("policy",))
ENGINE_BUSY = Family("atopgpud_gpu_engine_busy_percent", "gauge",
                     "Busy percentage of a video or image engine over the driver's last sampling period.",
                     ("engine",))
PCIE_THROUGHPUT = Family("atopgpud_gpu_pcie_throughput_bytes_per_second", "gauge",
                         "PCIe traffic of the GPU over the driver's last 20 ms window, by direction.",
                         ("direction",))
PCIE_GENERATION = Family("atopgpud_gpu_pcie_link_generation", "gauge", "The PCIe generation the link runs at now.")
PCIE_WIDTH = Family("atopgpud_gpu_pcie_link_width", "gauge", "The PCIe lanes the link runs with now.")
NVLINK_BYTES = Family("atopgpud_gpu_nvlink_bytes_total", "counter", "Data sent and received over an active NVLink.",
                      ("direction", "link"))
NVLINK_ERRORS = Family("atopgpud_gpu_nvlink_errors_total", "counter", "Errors of an active NVLink, by kind.",
                       ("error", "link"))
CLOCK_MAX = Family("atopgpud_gpu_clock_max_hertz", "gauge", "The highest clock frequency of a clock domain.",
                   ("clock",))
TEMPERATURE_THRESHOLD = Family("atopgpud_gpu_temperature_threshold_celsius", "gauge",
                               "Temperature thresholds: the GPU slows down, shuts down, or is past its maximum "
                               "operating temperature at these.", ("threshold",))

#: the clocks-event (throttle) reasons, by bit: nvmlClocksEventReason* of nvml.h
CLOCKS_EVENT_REASONS = (
    ("gpu_idle", 0x1),
    ("applications_clocks_setting", 0x2),
    ("sw_power_cap", 0x4),
    ("hw_slowdown", 0x8),
    ("sync_boost", 0x10),
    ("sw_thermal_slowdown", 0x20),
    ("hw_thermal_slowdown", 0x40),
    ("hw_power_brake_slowdown", 0x80),
    ("display_clock_setting", 0x100),
)
#: nvmlClockType_t, by the label shown
CLOCK_TYPES = (("graphics", 0, "graphics_clock"), ("sm", 1, "sm_clock"), ("memory", 2, "mem_clock"),
               ("video", 3, "video_clock"))
#: the most NVLinks a GPU has (NVML_NVLINK_MAX_LINKS of nvml.h)
NVLINK_MAX_LINKS = 18
NS = 1e-9


def _reason(name: str, bit: int) -> Figure:
    tag = "display_clocks_setting" if name == "display_clock_setting" else name
    return Figure(CLOCKS_EVENT, (("reason", name),),
                  Ask("nvmlDeviceGetCurrentClocksEventReasons", bit=bit,
                      older=("nvmlDeviceGetCurrentClocksThrottleReasons",)),
                  Smi((f"clocks_event_reasons/clocks_event_reason_{tag}",
                       f"clocks_throttle_reasons/clocks_throttle_reason_{tag}"), parse="active"),
                  Show(("clocks_event_reasons",)),
                  Play("clocks_event_reasons", 0, 0, 2**64 - 1))


def _ecc(error: str, kind: int, counter: str, counter_type: int) -> Figure:
    base = f"ecc_errors/{counter}"
    parts: tuple[tuple[str, ...], ...]
    if error == "corrected":
        old, parts = "single_bit/total", ((f"{base}/sram_correctable",), (f"{base}/dram_correctable",))
    else:
        old = "double_bit/total"
        parts = ((f"{base}/sram_uncorrectable",
                  f"{base}/sram_uncorrectable_parity+{base}/sram_uncorrectable_secded"),
                 (f"{base}/dram_uncorrectable",))
    column = {"corrected": "ECC-C", "uncorrected": "ECC-U"}[error] if counter == "volatile" else None
    return Figure(ECC, (("error", error), ("counter", counter)),
                  Ask("nvmlDeviceGetTotalEccErrors", (kind, counter_type),
                      variant=f"nvmlDeviceGetTotalEccErrors {error} {counter}"),
                  Smi((f"{base}/{old}",), parts=parts),
                  Show(("ecc_errors", error, counter), column=column),
                  Play(f"ecc_{error}_{counter}", 0))


#: every figure, in the order the NVML reader asks and the page lists the families
FIGURES: tuple[Figure, ...] = (
    Figure(TEMPERATURE, (), Ask("nvmlDeviceGetTemperature", (0,)), Smi(("temperature/gpu_temp",), most=250.0),
           Show(("temperature_c",), column="TEMP", unit="C"), Play("temperature_c", 40)),
    Figure(MEMORY_TEMPERATURE, (), Ask("nvmlDeviceGetFieldValues", field=82,
                                       variant="nvmlDeviceGetFieldValues memory temperature"),
           Smi(("temperature/memory_temp",), most=250.0),
           Show(("memory_temperature_c",), column="MEMTEMP", unit="C"), Play("memory_temperature_c", None)),
    Figure(POWER, (), Ask("nvmlDeviceGetPowerUsage", scale=0.001),
           Smi(("gpu_power_readings/instant_power_draw", "gpu_power_readings/power_draw", "power_readings/power_draw"),
               most=100_000.0),
           Show(("power_w",), column="POWER", unit="W", decimals=1), Play("power_w", 60, per=1000)),
    Figure(POWER_LIMIT, (), Ask("nvmlDeviceGetEnforcedPowerLimit", scale=0.001),
           Smi(("gpu_power_readings/current_power_limit", "power_readings/enforced_power_limit"), most=100_000.0),
           Show(("power_limit_w",), column="LIMIT", unit="W"), Play("power_limit_w", 300, per=1000)),
    Figure(ENERGY, (), Ask("nvmlDeviceGetTotalEnergyConsumption", scale=0.001), None,
           Show(("energy_j",), column="ENERGY", unit="kJ", decimals=1, column_per=1000),
           Play("energy_start_j", 0, per=1000)),
    *(Figure(CLOCK, (("clock", label),), Ask("nvmlDeviceGetClockInfo", (kind,), 1e6,
                                             variant=f"nvmlDeviceGetClockInfo {label}"),
             Smi((f"clocks/{element}",), 1e6, most=100e9),
             # video: a key of its own, clocks_mhz keeps the three it always had
             Show(("video_clock_mhz",), per=1e6) if label == "video"
             else Show(("clocks_mhz", label), per=1e6, column={"sm": "SM", "memory": "MEM"}.get(label), unit="MHz"),
             Play(f"{label}_clock_mhz", {"graphics": 1410, "sm": 1410, "memory": 1215}.get(label)))
      for label, kind, element in CLOCK_TYPES),
    *(_reason(name, bit) for name, bit in CLOCKS_EVENT_REASONS),
    Figure(PSTATE, (), Ask("nvmlDeviceGetPerformanceState", below=32), Smi(("performance_state",), parse="pstate"),
           Show(("performance_state",), column="PSTATE", prefix="P"), Play("performance_state", 0, 0, 15)),
    Figure(FAN, (), Ask("nvmlDeviceGetFanSpeed"), Smi(("fan_speed",), most=100.0),
           Show(("fan_percent",), column="FAN", unit="%"), Play("fan_percent", None, 0, 100)),
    *(_ecc(error, kind, counter, counter_type) for error, kind in (("corrected", 0), ("uncorrected", 1))
      for counter, counter_type in (("volatile", 0), ("aggregate", 1))),
    # nvmlDeviceGetRemappedRows answers (correctable, uncorrectable, pending, failed): picked by place
    *(Figure(family, labels, Ask("nvmlDeviceGetRemappedRows", pick=index, flag=flag),
             Smi((f"remapped_rows/{element}",), parse="yes_no" if flag else "number"),
             Show(key), Play(field, 0, 0, 1 if flag else None))
      for index, (family, labels, element, key, field, flag) in enumerate((
          (REMAPPED, (("cause", "correctable"),), "remapped_row_corr", ("remapped_rows", "correctable"),
           "remapped_rows_correctable", False),
          (REMAPPED, (("cause", "uncorrectable"),), "remapped_row_unc", ("remapped_rows", "uncorrectable"),
           "remapped_rows_uncorrectable", False),
          (REMAP_PENDING, (), "remapped_row_pending", ("row_remap_pending",), "remapped_rows_pending", True),
          (REMAP_FAILED, (), "remapped_row_failure", ("row_remap_failed",), "remapped_rows_failed", True)))),
    Figure(PCIE_REPLAYS, (), Ask("nvmlDeviceGetPcieReplayCounter"), Smi(("pci/replay_counter",)),
           Show(("pcie_replays",)), Play("pcie_replays", 0)),
    # throttling as time: the clocks-event durations (ns) and each performance policy's violation time (ns)
    *(Figure(CLOCKS_EVENT_TIME, (("reason", name),),
             Ask("nvmlDeviceGetFieldValues", scale=NS, field=field,
                 variant=f"nvmlDeviceGetFieldValues clocks event {name}"),
             Smi((f"clocks_event_reasons_counters/clocks_event_reasons_counters_{element}",), 1e-6),
             Show(("clocks_event_seconds", name)), Play(f"clocks_event_{name}_s", None, per=1e9))
      for name, field, element in (
          ("sw_power_cap", 74, "sw_power_cap"), ("sync_boost", 76, "sync_boost"),
          ("sw_thermal_slowdown", 269, "sw_therm_slowdown"), ("hw_thermal_slowdown", 270, "hw_therm_slowdown"),
          ("hw_power_brake_slowdown", 271, "hw_power_brake"))),
    *(Figure(VIOLATION_TIME, (("policy", policy),),
             Ask("nvmlDeviceGetViolationStatus", (kind,), NS, variant=f"nvmlDeviceGetViolationStatus {policy}",
                 pick="violationTime"),
             None, Show(("violation_seconds", policy)), Play(f"violation_{policy}_s", None, per=1e9))
      for policy, kind in (("power", 0), ("thermal", 1), ("sync_boost", 2), ("board_limit", 3), ("low_utilization", 4),
                           ("reliability", 5), ("total_app_clocks", 10), ("total_base_clocks", 11))),
    *(Figure(ENGINE_BUSY, (("engine", engine),), Ask(f"nvmlDeviceGet{function}Utilization", pick=0),
             Smi((f"utilization/{engine}_util",), most=100.0), Show(("engine_busy_percent", engine)),
             Play(f"{engine}_percent", None, 0, 100))
      for engine, function in (("encoder", "Encoder"), ("decoder", "Decoder"), ("jpeg", "Jpg"), ("ofa", "Ofa"))),
    *(Figure(PCIE_THROUGHPUT, (("direction", direction),),
             Ask("nvmlDeviceGetPcieThroughput", (counter,), 1024.0, variant=f"nvmlDeviceGetPcieThroughput {direction}"),
             Smi((f"pci/{direction}_util",), 1024.0, most=1e12), Show(("pcie_kib_per_second", direction), 1024),
             Play(f"pcie_{direction}_kib_s", None))
      for direction, counter in (("tx", 0), ("rx", 1))),
    Figure(PCIE_GENERATION, (), Ask("nvmlDeviceGetCurrPcieLinkGeneration"),
           Smi(("pci/pci_gpu_link_info/pcie_gen/current_link_gen",), most=32.0), Show(("pcie_link_generation",)),
           Play("pcie_link_generation", None)),
    Figure(PCIE_WIDTH, (), Ask("nvmlDeviceGetCurrPcieLinkWidth"),
           Smi(("pci/pci_gpu_link_info/link_widths/current_link_width",), most=64.0), Show(("pcie_link_width",)),
           Play("pcie_link_width", None)),
    # NVLink: per active link (the simulator plays them from the list `nvlink`, a shape of its own)
    *(Figure(NVLINK_BYTES, (("direction", direction),),
             Ask("nvmlDeviceGetFieldValues", scale=1024.0, field=field, per_link=True,
                 variant=f"nvmlDeviceGetFieldValues nvlink {direction}"),
             None, Show(("nvlink_bytes", direction)), Play(f"{direction}_kib_per_s", 0, per=1))
      for direction, field in (("tx", 138), ("rx", 139))),
    *(Figure(NVLINK_ERRORS, (("error", error),),
             Ask("nvmlDeviceGetNvLinkErrorCounter", (counter,), per_link=True,
                 variant=f"nvmlDeviceGetNvLinkErrorCounter {error}"),
             None, Show(("nvlink_errors", error)), Play(f"{error}_errors", 0))
      for error, counter in (("replay", 0), ("recovery", 1), ("crc_flit", 2), ("crc_data", 3))),
    *(Figure(CLOCK_MAX, (("clock", label),),
             Ask("nvmlDeviceGetMaxClockInfo", (kind,), 1e6, variant=f"nvmlDeviceGetMaxClockInfo {label}"),
             Smi((f"max_clocks/{element}",), 1e6, most=100e9), Show(("max_clocks_mhz", label), 1e6),
             Play(f"max_{label}_clock_mhz", None))
      for label, kind, element in CLOCK_TYPES),
    *(Figure(TEMPERATURE_THRESHOLD, (("threshold", name),),
             Ask("nvmlDeviceGetTemperatureThreshold", (kind,), variant=f"nvmlDeviceGetTemperatureThreshold {name}"),
             Smi((f"temperature/{element}",), most=250.0), Show(("temperature_threshold_c", name)),
             Play(f"temperature_{name}_c", None))
      for name, kind, element in (
          ("shutdown", 0, "gpu_temp_max_threshold"), ("slowdown", 1, "gpu_temp_slow_threshold"),
          ("memory_max", 2, "gpu_temp_max_mem_threshold"), ("gpu_max", 3, "gpu_temp_max_gpu_threshold"))),
)


def _gpm(name: str, metric: int, unit: str, series: str, text: str, play: Play | None = None,
         column: str | None = None) -> Figure:
    """A GPM row: `series` without ``atopgpud_gpu_gpm_`` and ``_total``; `text` what it is, for the help."""
    if unit == PERCENT:
        family = Family(f"atopgpud_gpu_gpm_{series}_total", "counter", f"GPM: {text}, exact over each poll, times "
                        "the seconds it covers, summed: rate() is the average percentage.")
        show = Show((name,), column=column, unit="%", decimals=1)
    else:
        family = Family(f"atopgpud_gpu_gpm_{series}_total", "counter", f"GPM: {text}, exact over each poll, summed.")
        show = Show((f"{name}_mib_s",), per=MIB, column=column, unit="MiB/s", decimals=1)
    return Figure(family, show=show, play=play, gpm=Gpm(name, metric, unit))


def _share(field: str, default: float, follows: str = "gpu") -> Play:
    return Play(field, default, 0, 1, follows=follows)


#: no link of today's GPUs moves more, MiB/s (NVLink 5: 1.8 TB/s): the simulator's bound
MAX_RATE = 10_000_000

#: every GPM figure, in the order the page lists the families and ``atopgpu --gpm`` its keys.  The
#: page's series carry the label ``index`` besides the card's; `Show` is ``atopgpu --gpm``'s (the JSON
#: value: the counter's increase over that of the seconds covered, divided by `per`); `Play` is a
#: field of a scenario GPU's ``gpm`` object (none: the graphics activity itself, as the timelines play it)
GPM_FIGURES: tuple[Figure, ...] = (
    _gpm("graphics", 1, PERCENT, "graphics_percent_seconds", "graphics or compute activity (any engine busy)",
         column="GRACT"),  # GRAPHICS_UTIL
    _gpm("sm", 2, PERCENT, "sm_active_percent_seconds", "SM activity (the share of SMs busy)",
         _share("sm_share", 0.9), "SMACT"),  # SM_UTIL
    _gpm("sm_occupancy", 3, PERCENT, "sm_occupancy_percent_seconds", "SM occupancy (warps resident of the most)",
         _share("occupancy_share", 0.5), "SMOCC"),  # SM_OCCUPANCY
    _gpm("tensor", 5, PERCENT, "tensor_active_percent_seconds", "tensor pipe activity (any tensor operation)",
         _share("tensor_share", 0.0), "TENSOR"),  # ANY_TENSOR_UTIL
    _gpm("dram", 10, PERCENT, "dram_bandwidth_percent_seconds", "DRAM bandwidth used of the most",
         _share("dram_share", 1.0, "mem"), "DRAM"),  # DRAM_BW_UTIL
    _gpm("fp64", 11, PERCENT, "fp64_active_percent_seconds", "FP64 pipe activity (not tensor)",
         _share("fp64_share", 0.0)),  # FP64_UTIL
    _gpm("fp32", 12, PERCENT, "fp32_active_percent_seconds", "FP32 pipe activity (not tensor)",
         _share("fp32_share", 0.0)),  # FP32_UTIL
    _gpm("fp16", 13, PERCENT, "fp16_active_percent_seconds", "FP16 pipe activity (not tensor)",
         _share("fp16_share", 0.0)),  # FP16_UTIL
    _gpm("pcie_tx", 20, MIB_PER_SECOND, "pcie_transmit_bytes", "PCIe bytes sent by the GPU",
         Play("pcie_tx_mib_s", 0.0, 0, MAX_RATE), "PCIE-TX"),  # PCIE_TX_PER_SEC
    _gpm("pcie_rx", 21, MIB_PER_SECOND, "pcie_receive_bytes", "PCIe bytes received by the GPU",
         Play("pcie_rx_mib_s", 0.0, 0, MAX_RATE), "PCIE-RX"),  # PCIE_RX_PER_SEC
    _gpm("nvlink_tx", 61, MIB_PER_SECOND, "nvlink_transmit_bytes", "NVLink bytes written, all links",
         Play("nvlink_tx_mib_s", 0.0, 0, MAX_RATE), "NVL-TX"),  # NVLINK_TOTAL_TX_PER_SEC
    _gpm("nvlink_rx", 60, MIB_PER_SECOND, "nvlink_receive_bytes", "NVLink bytes read, all links",
         Play("nvlink_rx_mib_s", 0.0, 0, MAX_RATE), "NVL-RX"),  # NVLINK_TOTAL_RX_PER_SEC
)


@dataclass(frozen=True)
class Inventory:
    """One label of the inventory series: the `DeviceInfo` field it shows (snapshot.py), the NVML
    call it is read with when a card is discovered, and where nvidia-smi's report has it."""

    label: str
    attribute: str
    nvml: str
    #: the path under ``<gpu>``, or under ``<nvidia_smi_log>`` for the driver's own
    smi: str
    smi_root: bool = False


#: the inventory series: value 1, the card's index, bus id and name, then `INVENTORY`'s labels
INFO = Family("atopgpud_gpu_info", "gauge", "What each GPU (or MIG instance) is, value 1: its UUID, serial, driver, "
              "CUDA driver and VBIOS versions and MIG profile (empty where unknown); join on uuid.",
              ("index", "busid", "uuid", "name", "serial", "driver_version", "cuda_driver_version", "vbios",
               "mig_profile"))
#: what each MIG instance is part of, value 1: a series of its own rather than labels on every series
#: (which would change every series' identity, and a card's series have none of them)
MIG_INFO = Family("atopgpud_mig_info", "gauge", "Each MIG instance, value 1: its UUID, its card's UUID "
                  "(parent_uuid), its GPU and compute instance ids and its profile; join on uuid.",
                  ("index", "busid", "uuid", "parent_uuid", "gpu_instance", "compute_instance", "mig_profile"))
#: the labels of `INFO` that say what a device is, in its order
INVENTORY = (
    Inventory("uuid", "uuid", "nvmlDeviceGetUUID", "uuid"),
    Inventory("serial", "serial", "nvmlDeviceGetSerial", "serial"),
    Inventory("driver_version", "driver_version", "nvmlSystemGetDriverVersion", "driver_version", smi_root=True),
    Inventory("cuda_driver_version", "cuda_version", "nvmlSystemGetCudaDriverVersion_v2", "cuda_version",
              smi_root=True),
    Inventory("vbios", "vbios", "nvmlDeviceGetVbiosVersion", "vbios_version"),
    Inventory("mig_profile", "mig_profile", "nvmlDeviceGetName (of a MIG instance)", "mig_devices"),
)


def families() -> dict[str, Family]:
    """Every family, by name, in the order the page lists them (the order of its first row)."""
    return {figure.family.name: figure.family for figure in FIGURES}


def played_fields() -> dict[str, Play]:
    """The simulator's fields of a card's figures (one field may play several rows, alike), by name."""
    return {f.play.field: f.play for f in FIGURES if f.play is not None and not (f.nvml and f.nvml.per_link)}


def link_fields() -> dict[str, Play]:
    """The simulator's fields of one NVLink, by name."""
    return {f.play.field: f.play for f in FIGURES if f.play is not None and f.nvml and f.nvml.per_link}
