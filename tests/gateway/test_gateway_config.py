"""The fleet file: the documented example loads, and every kind of mistake is said clearly."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tokenmill.cli.main import main
from tokenmill.gateway.config import ConfigError, load_config, parse_config

DOC = Path(__file__).parents[2] / "docs" / "gateway.md"


def example() -> dict[str, Any]:
    block = re.search(r"```yaml\n(.*?)```", DOC.read_text(), re.S)
    assert block is not None
    return dict(yaml.safe_load(block[1]))


def minimal(**overrides: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "regions": {"eu": {"residency": "eu"}},
        "models": [{"name": "m"}],
        "pools": [{"name": "p", "model": "m", "region": "eu", "backends": [{"url": "http://127.0.0.1:1"}]}],
    }
    config.update(overrides)
    return config


def error(data: Any) -> str:
    with pytest.raises(ConfigError) as exc:
        parse_config(data, "fleet.yaml")
    return str(exc.value)


def test_documented_example_is_valid() -> None:
    config = parse_config(example(), "docs")
    assert [p.name for p in config.pools] == ["eu-fast", "eu-deep", "us", "eu-lite"]
    assert config.pools[0].backends[1].name == "eu-2"
    assert config.priorities.classes["batch"].cheapest_region
    assert config.tiers is not None and config.tiers.cascade.min_mean_logprob == -1.5
    assert config.models[0].upstream == "smollm2-135m-instruct"


def test_defaults() -> None:
    config = parse_config(minimal())
    assert config.pools[0].policy == "prefix_aware"
    assert (config.pools[0].load_factor, config.pools[0].load_slack) == (1.25, 2)
    assert config.pools[0].backends[0].kind == "tokenmill"
    assert config.gateway.retries_before_first_byte == 1
    assert sorted(config.priorities.classes) == ["batch", "interactive"]


@pytest.mark.parametrize(("change", "message"), [
    ({"pools": [{"name": "p", "model": "m", "region": "eu", "policy": "random"}]},
     "fleet.yaml: pools[0].policy: Input should be 'round_robin', 'least_load', 'prefix_aware' or 'session_affinity'"),
    ({"pools": [{"name": "p", "model": "m", "region": "eu", "backends": [{"url": "localhost:8000"}]}]},
     "fleet.yaml: pools[0].backends[0].url: String should match pattern"),
    ({"pools": [{"name": "p", "model": "nope", "region": "eu"}]},
     "fleet.yaml: pools[0].model: unknown model 'nope'; models are ['m']"),
    ({"pools": [{"name": "p", "model": "m", "region": "mars"}]},
     "fleet.yaml: pools[0].region: unknown region 'mars'; regions are ['eu']"),
    ({"pools": [{"name": "p", "model": "m", "region": "eu", "load_slack": -1}]},
     "fleet.yaml: pools[0].load_slack: Input should be greater than or equal to 0"),
    ({"pools": [{"name": "p", "model": "m", "region": "eu", "bakends": []}]},
     "fleet.yaml: pools[0].bakends: Extra inputs are not permitted"),
    ({"tenants": [{"name": "t", "residency": ["us"]}]},
     "fleet.yaml: tenants[0].residency: unknown zone 'us'; zones are ['eu']"),
    ({"tenants": [{"name": "t", "api_key_sha256": ["plain-text-key"]}]},
     "must be a lowercase hex sha256 digest"),
    ({"degradation": [{"at_load": 0.8, "action": "cap_max_tokens", "classes": ["batch"]}]},
     "fleet.yaml: degradation[0]: cap_max_tokens needs max_tokens"),
    ({"tiers": {"models": {"small": "m"}, "default": "medium"}},
     "fleet.yaml: tiers: unknown tier 'medium'; tiers are ['small']"),
    ({"models": [{"name": "m"}, {"name": "m"}]}, "fleet.yaml: models: duplicate name 'm'"),
    ({"regions": {"eu": {"residency": "eu", "hours": {"22-6": 0.5}}}},
     "fleet.yaml: regions.eu.hours: hour range '22-6' must be 'start-end' with 0 <= start < end <= 24"),
    ({"auth": {"anonymous_tenant": "ghost"}}, "auth.anonymous_tenant 'ghost' is not a tenant"),
    ({"redis_url": "localhost:6379"}, "fleet.yaml: redis_url: String should match pattern"),
])
def test_mistakes_name_the_field(change: dict[str, Any], message: str) -> None:
    assert message in error(minimal(**change))


def test_missing_sections_and_wrong_shapes() -> None:
    assert error({"models": []}) == (
        "fleet.yaml: regions: Field required; pools: Field required")
    assert error(["a"]) == "fleet.yaml: the top level must be a mapping, got list"


def test_load_config_reports_unreadable_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"missing.yaml: cannot read: No such file or directory"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("regions:\n  eu: {residency: eu\nmodels: []\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: not valid YAML/JSON at line \d+, column \d+"):
        load_config(bad)
    good = tmp_path / "fleet.json"
    good.write_text('{"regions": {"eu": {"residency": "eu"}}, "models": [{"name": "m"}], "pools": []}')
    assert load_config(good).models[0].name == "m"


def test_cli_check_exits_2_with_the_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(minimal(pools=[{"name": "p", "model": "m", "region": "eu", "policy": "x"}])))
    assert main(["gateway", "--config", str(path), "--check"]) == 2
    assert f"tokenmill gateway: {path}: pools[0].policy: Input should be" in capsys.readouterr().err
    path.write_text(yaml.safe_dump(minimal()))
    assert main(["gateway", "--config", str(path), "--check"]) == 0
    assert capsys.readouterr().out == f"{path}: ok (1 pools, 1 backends)\n"
