"""``atopgpu --health``: the health figures of one host, read from the daemon's metrics page."""

from __future__ import annotations

import contextlib
import http.server
import json
import threading
import time
from typing import Iterator

import pytest
from daemon import free_port, run_daemon

from atopgpud_tw.atopgpu import cli
from atopgpud_tw.atopgpu.connection import BadReply
from atopgpud_tw.atopgpu.health import health_report, render_health

PAGE = """# TYPE atopgpud_build_info gauge
atopgpud_build_info{version="0.2.0"} 1
atopgpud_gpu_present{index="0",busid="00000000:17:00.0",type="H100"} 1
atopgpud_gpu_temperature_celsius{busid="00000000:17:00.0",type="H100"} 67
atopgpud_gpu_power_watts{busid="00000000:17:00.0",type="H100"} 612.4
atopgpud_gpu_clock_hertz{busid="00000000:17:00.0",clock="sm",type="H100"} 1.755e+09
atopgpud_gpu_clocks_event_active{busid="00000000:17:00.0",reason="sw_power_cap",type="H100"} 1
atopgpud_gpu_clocks_event_active{busid="00000000:17:00.0",reason="gpu_idle",type="H100"} 0
# TYPE atopgpud_gpu_ecc_errors counter
atopgpud_gpu_ecc_errors_total{busid="00000000:17:00.0",counter="volatile",error="uncorrected",type="H100"} 2
# TYPE atopgpud_gpu_xid_errors counter
atopgpud_gpu_xid_errors_total{busid="00000000:17:00.0",type="H100",xid="79"} 1
atopgpud_gpu_health_stale{busid="00000000:17:00.0",type="H100"} 1
atopgpud_gpu_present{index="1",busid="00000000:18:00.0",type="NVIDIA A10"} 0
atopgpud_gpu_present{index="2",busid="00000000:19:00.0/1.0",type="A100 MIG 3g.20gb"} 1
atopgpud_gpu_temperature_celsius{busid="00000000:19:00.0",type="A100"} 50
atopgpud_gpu_fan_speed_percent{busid="00000000:18:00.0",type="NVIDIA A10"} 30
"""


def test_report_reads_the_page_and_leaves_absent_figures_null():
    """Figures in their units, reasons as names, XIDs by code; null for what the card does not report."""
    doc = health_report(PAGE, "http://h/metrics")
    h100, a10, a100 = doc["gpus"]
    assert a100["present"] is True  # a MIG card: present when an instance of it is
    assert h100["temperature_c"] == 67 and h100["power_w"] == 612.4
    assert h100["clocks_mhz"] == {"graphics": None, "sm": 1755, "memory": None}
    assert h100["clocks_event_reasons"] == ["sw_power_cap"]
    assert h100["ecc_errors"]["uncorrected"]["volatile"] == 2
    assert h100["ecc_errors"]["corrected"]["volatile"] is None
    assert h100["xid_errors"] == {"79": 1}
    assert h100["stale"] is True and h100["present"] is True
    assert h100["memory_temperature_c"] is None and h100["energy_j"] is None
    assert a10["present"] is False and a10["fan_percent"] == 30
    table = render_health(doc)
    assert "612.4W" in table and "79x1" in table and "sw_power_cap" in table
    assert "(stale)" in table and "(gone)" in table


def test_a_page_that_is_not_the_daemons_is_refused():
    """A page without atopgpud_build_info, or not in the text format, is a bad reply (exit status 3)."""
    with pytest.raises(BadReply, match="not an atopgpud metrics page"):
        health_report("up 1\n", "http://h/metrics")
    with pytest.raises(BadReply):
        health_report("this is { not a page\n", "http://h/metrics")


def test_no_daemon_is_exit_status_1_and_bad_usage_2(capsys):
    """Connection refused: one line, status 1; --metrics-url without --health: status 2."""
    port = free_port()
    assert cli.main(["--health", "--metrics-url", f"http://127.0.0.1:{port}/metrics"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("atopgpu: ") and err.count("\n") == 1 and "--metrics" in err
    with pytest.raises(SystemExit) as stopped:
        cli.main(["--metrics-url", "http://127.0.0.1:1/metrics"])
    assert stopped.value.code == 2


@pytest.mark.e2e
def test_health_json_from_a_daemon_on_the_simulator(tmp_path, capsys):
    """Against a daemon: the scenario's power, its unsupported fan left null, its XID counted."""
    port = free_port()
    scenario = {"gpus": [{"health": {"power_w": 275, "xid_events": [[1.5, 48]]}}]}
    with run_daemon(tmp_path, ["--interval", "0.5", "--metrics", f"tcp:{port}:interface=127.0.0.1"],
                    scenario=scenario) as daemon:
        daemon.wait_samples(4)  # past 1.5 s of simulated time
        url = f"http://127.0.0.1:{port}/metrics"
        deadline = time.monotonic() + 30
        while True:
            assert cli.main(["--health", "--json", "--metrics-url", url]) == 0
            doc = json.loads(capsys.readouterr().out)
            if doc["gpus"][0]["xid_errors"] or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        gpu = doc["gpus"][0]
        assert gpu["power_w"] == 275 and gpu["fan_percent"] is None
        assert gpu["xid_errors"] == {"48": 1}
        assert cli.main(["--health", "--metrics-url", url]) == 0
        assert "48x1" in capsys.readouterr().out


#: what a hostile label sends a terminal: clear the screen, set the window title
HOSTILE = "\x1b[2J\x1b]0;PWN\x07"
SHOWN = "\\x1b[2J\\x1b]0;PWN\\x07"
HOSTILE_PAGE = f"""# TYPE atopgpud_build_info gauge
atopgpud_build_info{{version="0.2.0"}} 1
atopgpud_gpu_present{{index="0",busid="{HOSTILE}:17:00.0",type="H100{HOSTILE}"}} 1
atopgpud_gpu_temperature_celsius{{busid="{HOSTILE}:17:00.0",type="H100{HOSTILE}"}} 67
atopgpud_gpu_clocks_event_active{{busid="{HOSTILE}:17:00.0",reason="sw{HOSTILE}",type="H100{HOSTILE}"}} 1
atopgpud_gpu_xid_errors_total{{busid="{HOSTILE}:17:00.0",type="H100{HOSTILE}",xid="7\\n9{HOSTILE}"}} 1
"""


def controls(text: str) -> list[str]:
    """The characters of `text` a terminal would act on (a newline ends a line: allowed)."""
    return [c for c in text if (ord(c) < 0x20 and c != "\n") or 0x7F <= ord(c) <= 0x9F]


@contextlib.contextmanager
def page_server(body: str, status: int = 200, reason: str = "OK") -> Iterator[str]:
    """A metrics page on a local port, answered with `status` and `reason`; yields its URL."""

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            data = body.encode()
            self.send_response(status, reason)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/metrics"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_labels_of_a_page_are_shown_as_data(capsys):
    """Bus id, type, reason and XID labels with escapes (and an escaped newline): visible, never sent raw."""
    with page_server(HOSTILE_PAGE) as url:
        assert cli.main(["--health", "--metrics-url", url]) == 0
        out, err = capsys.readouterr()
        assert err == "" and controls(out) == []
        row = out.splitlines()[2].split()
        assert row[:2] == [f"{SHOWN}:17:00.0", f"H100{SHOWN}"]
        assert row[-2:] == [f"7\\x0a9{SHOWN}x1", f"sw{SHOWN}"]
        assert cli.main(["--health", "--json", "--metrics-url", url]) == 0
        out = capsys.readouterr().out
    assert controls(out) == []
    gpu = json.loads(out)["gpus"][0]
    assert (gpu["busid"], gpu["xid_errors"]) == (f"{HOSTILE}:17:00.0", {f"7\n9{HOSTILE}": 1})


def test_an_error_from_a_page_is_one_line_of_data(capsys):
    """A page's HTTP reason phrase is quoted in the error: escaped, status 3, one line."""
    with page_server("", status=500, reason=f"Broken{HOSTILE}") as url:
        assert cli.main(["--health", "--metrics-url", url]) == 3
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and controls(err) == []
    assert err == f"atopgpu: {url}: HTTP 500 Broken{SHOWN}\n"
