"""`pdmesh up` and `pdmesh --help` edges a new user hit (issue 15 item 5), without a mesh."""

from __future__ import annotations

import socket
import subprocess
import sys

from pdmesh import cli


def test_every_subcommand_has_a_description_in_help():
    out = subprocess.run(
        [sys.executable, "-m", "pdmesh", "--help"], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    line = next(x for x in out.splitlines() if x.strip().startswith("health"))
    assert len(line.split()) > 1, line  # a description follows the name


def test_a_port_in_use_is_reported_before_anything_starts(tmp_path, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = cli.main(["up", "--router-port", str(port), "--gateway-port", "0", "--workdir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 1
    assert f"port {port} on 127.0.0.1 is already in use" in err and "--router-port 0" in err
    assert "Traceback" not in err
    assert not list(tmp_path.glob("*.log"))  # no service was started


def test_up_has_metrics_kv_blocks_and_restart_options():
    args = cli.build_parser().parse_args(["up", "--metrics-port", "9100", "--kv-blocks", "512", "--restart"])
    from pdmesh.commands import mesh_specs

    specs = mesh_specs(args)
    ports = [s.args[s.args.index("--metrics-port") + 1] for s in specs]
    assert ports == [str(9100 + i) for i in range(len(specs))]
    workers = [s for s in specs if s.name.startswith(("prefill", "decode"))]
    assert workers and all(s.args[s.args.index("--engine-num-blocks") + 1] == "512" for s in workers)
    assert args.restart
