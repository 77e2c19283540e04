from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from extproc.settings import SettingsError, load_settings, parse_routing, parse_settings
from tests.routing.conftest import BASE


def test_a_missing_key_is_named() -> None:
    raw = {k: v for k, v in BASE.items() if k != "epsilon"}
    with pytest.raises(SettingsError, match=r"epsilon: missing"):
        parse_routing(raw)


@pytest.mark.parametrize(
    ("key", "value", "complaint"),
    [
        ("epsilon", 0, "greater than 0"),
        ("epsilon", -1.0, "greater than 0"),
        ("virtual_nodes", 0, "greater than 0"),
        ("policy", "random", "round-robin"),
        ("load_unit", "bytes", "requests"),
        ("cache_aware", "maybe", "boolean"),
        ("long_load_factor", 1.0, "greater than 1"),
    ],
)
def test_bad_values_name_the_key_and_what_is_allowed(key: str, value: object, complaint: str) -> None:
    with pytest.raises(SettingsError) as error:
        parse_routing({**BASE, key: value})
    message = str(error.value)
    assert f"{key}:" in message and complaint in message


def test_unknown_keys_are_refused() -> None:
    with pytest.raises(SettingsError, match="epsilonn: unknown setting"):
        parse_routing({**BASE, "epsilonn": 0.2})


def test_environment_overrides_the_file(tmp_path: Path) -> None:
    reference = Path(__file__).parents[1] / "extproc" / "service" / "router.toml"
    if not reference.exists():
        pytest.skip("reference router.toml not written yet")
    settings = load_settings(reference, environ={"LLM_RING__ROUTING__EPSILON": "0.5",
                                                 "LLM_RING__ROUTING__POLICY": '"bounded"'})
    assert settings.routing.epsilon == 0.5 and settings.routing.policy == "bounded"


def test_missing_file_and_bad_toml_are_clear(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="not found"):
        load_settings(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[routing\n")
    with pytest.raises(SettingsError, match=re.escape(str(bad)) + ": not valid TOML"):
        load_settings(bad)


def test_the_policy_setting_accepts_exactly_the_registered_policies() -> None:
    """PolicyName (settings.py) is the one list of names; every policy class is typed to name
    one member of it, and this checks the registry covers all of them, in the same order."""
    from typing import get_args

    from extproc.routing import POLICIES
    from extproc.settings import PolicyName

    assert list(get_args(PolicyName)) == list(POLICIES)


@pytest.mark.parametrize(
    ("url", "complaint"),
    [
        ("http://127.0.0.1:6379", "should match pattern"),
        ("redis://127.0.0.1:port/0", "Port could not be cast"),
        ("redis://127.0.0.1:70000/0", "out of range"),
        ("redis://", "names a host"),
        ("unix://", "names the socket's path"),
    ],
)
def test_a_store_url_the_client_could_not_use_is_refused_by_key(url: str, complaint: str) -> None:
    raw = tomllib.loads((Path(__file__).parents[1] / "extproc" / "service" / "router.toml").read_text())
    raw["store"]["url"] = url
    with pytest.raises(SettingsError, match=re.escape("store.url: ") + ".*" + re.escape(complaint)):
        parse_settings(raw)
    raw["store"]["url"] = "redis://127.0.0.1:6379/0"
    assert parse_settings(raw).store.url == "redis://127.0.0.1:6379/0"
