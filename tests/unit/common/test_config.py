import argparse
from dataclasses import dataclass

import pytest

from services.common.config import ConfigError, add_arguments, build, reference, require, setting


@dataclass(frozen=True)
class Demo:
    port: int = setting(0, "a port")
    ratio: float = setting(0.5, "a ratio")
    name: str = setting("x", "a name")
    enabled: bool = setting(False, "a flag")
    peers: tuple[str, ...] = setting((), "comma-separated peers")
    limit: int | None = setting(None, "optional limit")

    def __post_init__(self):
        require(0 <= self.ratio <= 1, f"ratio must be in [0, 1], got {self.ratio}")


def parse(argv):
    p = argparse.ArgumentParser()
    add_arguments(p, Demo)
    return p.parse_args(argv)


def test_defaults_env_and_flags_in_order():
    env = {"PDMESH_PORT": "7", "PDMESH_NAME": "from-env", "PDMESH_PEERS": "a:1, b:2", "PDMESH_ENABLED": "yes"}
    cfg = build(Demo, parse(["--name", "from-flag"]), env)
    assert cfg.port == 7  # env beats default
    assert cfg.name == "from-flag"  # flag beats env
    assert cfg.peers == ("a:1", "b:2")
    assert cfg.enabled is True
    assert cfg.ratio == 0.5 and cfg.limit is None
    assert build(Demo, parse(["--limit", "3"]), {}).limit == 3


def test_bad_values_name_the_setting():
    with pytest.raises(ConfigError, match="--port"):
        build(Demo, parse(["--port", "eighty"]), {})
    with pytest.raises(ConfigError, match="PDMESH_ENABLED"):
        build(Demo, parse([]), {"PDMESH_ENABLED": "maybe"})
    with pytest.raises(ConfigError, match="ratio must be in"):
        build(Demo, parse(["--ratio", "2"]), {})


def test_config_is_frozen_and_reference_lists_every_field():
    cfg = build(Demo, None, {})
    with pytest.raises(AttributeError):
        cfg.port = 1  # type: ignore[misc]
    rows = reference(Demo)
    assert [r[0] for r in rows] == ["--port", "--ratio", "--name", "--enabled", "--peers", "--limit"]
    assert rows[0][1] == "PDMESH_PORT" and rows[0][3] == "a port"
