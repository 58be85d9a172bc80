"""Shift a child's wall clock (and CLOCK_BOOTTIME) while it runs: a tiny LD_PRELOAD library.

`clock_gettime`, `gettimeofday` and `time` answer CLOCK_REALTIME (and its coarse
variant) plus an offset, CLOCK_BOOTTIME plus another, both read from a file at
every call (``REAL_NS BOOT_NS``), so a test steps them by rewriting it.
CLOCK_MONOTONIC is left alone: it runs on, as it does when the wall clock is set.
A suspend is played by stopping the process (SIGSTOP) and moving both clocks
forward: its monotonic clock then advanced only while it was stopped, the wall
and boot clocks by far more, as across a real sleep.

The library is built with gcc into the test's folder (once per session); without
gcc the tests that need it skip with the reason.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

SOURCE = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdlib.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

static int (*real_clock_gettime)(clockid_t, struct timespec *);
static int shift_fd = -2;

static void offsets(long long *real, long long *boot) {
    char buf[96];
    ssize_t n;
    char *end;
    *real = *boot = 0;
    if (shift_fd == -2) {
        const char *path = getenv("TIMESHIFT_FILE");
        shift_fd = path ? open(path, O_RDONLY | O_CLOEXEC) : -1;
    }
    if (shift_fd < 0) return;
    n = pread(shift_fd, buf, sizeof buf - 1, 0);
    if (n <= 0) return;
    buf[n] = 0;
    *real = strtoll(buf, &end, 10);
    *boot = strtoll(end, &end, 10);
}

static void add(struct timespec *ts, long long ns) {
    long long total = (long long)ts->tv_nsec + ns % 1000000000LL;
    ts->tv_sec += ns / 1000000000LL + total / 1000000000LL;
    total %= 1000000000LL;
    if (total < 0) { total += 1000000000LL; ts->tv_sec -= 1; }
    ts->tv_nsec = total;
}

int clock_gettime(clockid_t id, struct timespec *ts) {
    long long real, boot;
    int rc;
    if (!real_clock_gettime) real_clock_gettime = dlsym(RTLD_NEXT, "clock_gettime");
    rc = real_clock_gettime(id, ts);
    if (rc != 0) return rc;
    if (id == CLOCK_REALTIME || id == CLOCK_REALTIME_COARSE) {
        offsets(&real, &boot);
        add(ts, real);
    } else if (id == CLOCK_BOOTTIME) {
        offsets(&real, &boot);
        add(ts, boot);
    }
    return rc;
}

int gettimeofday(struct timeval *tv, void *tz) {
    struct timespec ts;
    (void)tz;
    if (clock_gettime(CLOCK_REALTIME, &ts) != 0) return -1;
    if (tv) { tv->tv_sec = ts.tv_sec; tv->tv_usec = ts.tv_nsec / 1000; }
    return 0;
}

time_t time(time_t *out) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    if (out) *out = ts.tv_sec;
    return ts.tv_sec;
}
"""


def build(folder: Path) -> Path | str:
    """The library built in `folder`, or why it cannot be."""
    gcc = shutil.which("gcc")
    if gcc is None:
        return "gcc is not installed (apt-get install gcc libc6-dev)"
    source = folder / "timeshift.c"
    library = folder / "libtimeshift.so"
    source.write_text(SOURCE)
    done = subprocess.run([gcc, "-shared", "-fPIC", "-O2", "-o", str(library), str(source), "-ldl"],
                          capture_output=True, text=True)
    if done.returncode != 0:
        return f"gcc cannot build the LD_PRELOAD library: {done.stderr.strip()[:300]}"
    return library


class Shift:
    """The offsets file of one child: `set` moves its clocks."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.real_ns = 0
        self.boot_ns = 0
        self._write()

    def step(self, seconds: float) -> None:
        """Set the wall clock `seconds` away (back when negative)."""
        self.real_ns += int(seconds * 1e9)
        self._write()

    def sleep(self, seconds: float) -> None:
        """Both the wall and boot clocks `seconds` on (a suspend, with the process stopped)."""
        self.real_ns += int(seconds * 1e9)
        self.boot_ns += int(seconds * 1e9)
        self._write()

    def _write(self) -> None:
        # one write of a short line: a reader sees the old offsets or the new ones
        text = f"{self.real_ns} {self.boot_ns}\n".ljust(48)
        with open(self.path, "r+" if self.path.exists() else "w") as out:
            out.write(text)
