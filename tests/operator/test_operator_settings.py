"""Operator settings: environment, flags over environment, clear errors."""

from __future__ import annotations

import pytest

from pstrain_api import constants as c
from pstrain_operator.settings import OperatorSettings, SettingsError, load_settings


def test_defaults() -> None:
    assert load_settings([], {}) == OperatorSettings(
        namespaces=(), runtime_image=c.DEFAULT_RUNTIME_IMAGE, metrics_port=8080,
        health_port=8081, log_level="info", leader_election=False,
        job_pod_security="restricted", progress_interval=10.0)


def test_environment_and_flags() -> None:
    env = {"PSTRAIN_OPERATOR_NAMESPACES": "a, b,a", "PSTRAIN_OPERATOR_RUNTIME_IMAGE": "r:1",
           "PSTRAIN_OPERATOR_METRICS_PORT": "9000", "PSTRAIN_OPERATOR_HEALTH_PORT": "0",
           "PSTRAIN_OPERATOR_LOG_LEVEL": "DEBUG", "PSTRAIN_OPERATOR_LEADER_ELECTION": "true",
           "PSTRAIN_OPERATOR_JOB_POD_SECURITY": "none"}
    got = load_settings(["--runtime-image", "flag:2", "--namespaces", ""], env)
    assert got == OperatorSettings(namespaces=(), runtime_image="flag:2", metrics_port=9000,
                                   health_port=0, log_level="debug", leader_election=True,
                                   job_pod_security="none")
    assert load_settings([], env).namespaces == ("a", "b")
    assert load_settings([], env).clusterwide is False


@pytest.mark.parametrize("env,message", [
    ({"PSTRAIN_OPERATOR_METRICS_PORT": "x"},
     "PSTRAIN_OPERATOR_METRICS_PORT is 'x'; it must be a port number (0 disables)."),
    ({"PSTRAIN_OPERATOR_HEALTH_PORT": "70000"},
     "PSTRAIN_OPERATOR_HEALTH_PORT is 70000; it must be between 0 and 65535 (0 disables)."),
    ({"PSTRAIN_OPERATOR_LEADER_ELECTION": "maybe"},
     "PSTRAIN_OPERATOR_LEADER_ELECTION is 'maybe'; it must be true or false."),
    ({"PSTRAIN_OPERATOR_LOG_LEVEL": "loud"},
     "PSTRAIN_OPERATOR_LOG_LEVEL is 'loud'; it must be one of debug, info, warning, error."),
    ({"PSTRAIN_OPERATOR_JOB_POD_SECURITY": "lax"},
     "PSTRAIN_OPERATOR_JOB_POD_SECURITY is 'lax'; it must be one of restricted, none."),
    ({"PSTRAIN_OPERATOR_NAMESPACES": "Bad_NS"},
     "PSTRAIN_OPERATOR_NAMESPACES contains 'Bad_NS'; it must be a DNS-1123 label: at most 63 "
     "lowercase letters, digits and '-', starting and ending with a letter or digit "
     "(namespaces are comma-separated)."),
    ({"PSTRAIN_OPERATOR_NAMESPACES": "ok,-team"},
     "PSTRAIN_OPERATOR_NAMESPACES contains '-team'; it must be a DNS-1123 label: at most 63 "
     "lowercase letters, digits and '-', starting and ending with a letter or digit "
     "(namespaces are comma-separated)."),
    ({"PSTRAIN_OPERATOR_NAMESPACES": "équipe"},
     "PSTRAIN_OPERATOR_NAMESPACES contains 'équipe'; it must be a DNS-1123 label: at most 63 "
     "lowercase letters, digits and '-', starting and ending with a letter or digit "
     "(namespaces are comma-separated)."),
    ({"PSTRAIN_OPERATOR_RUNTIME_IMAGE": "x", "PSTRAIN_OPERATOR_LOG_LEVEL": "v" * 10_000},
     f"PSTRAIN_OPERATOR_LOG_LEVEL is '{'v' * 37}...{'v' * 38}' (10000 characters); it must "
     "be one of debug, info, warning, error."),
    ({"PSTRAIN_OPERATOR_PROGRESS_INTERVAL": "60"},
     "PSTRAIN_OPERATOR_PROGRESS_INTERVAL is 60; it must be between 1 and 30 seconds "
     "(progress is refreshed at least every 30 s)."),
    ({"PSTRAIN_OPERATOR_METRICS_PORT": "9000", "PSTRAIN_OPERATOR_HEALTH_PORT": "9000"},
     "the metrics port and the health port are both 9000; they must differ."),
    ({"PSTRAIN_OPERATOR_PS_LIVENESS_SECONDS": "5"},
     "PSTRAIN_OPERATOR_PS_LIVENESS_SECONDS is 5; it must be 0 (no liveness probe) or "
     "between 10 and 3600 seconds."),
    ({"PSTRAIN_OPERATOR_PS_LIVENESS_SECONDS": "1m"},
     "PSTRAIN_OPERATOR_PS_LIVENESS_SECONDS is '1m'; it must be a whole number of seconds "
     "(0 disables)."),
], ids=["port-not-number", "port-range", "bool", "log-level", "security", "namespace",
        "namespace-leading-dash", "namespace-not-ascii", "long-value-shortened", "interval",
        "same-ports", "liveness-range", "liveness-not-number"])
def test_errors_name_the_setting(env: dict[str, str], message: str) -> None:
    with pytest.raises(SettingsError) as err:
        load_settings([], env)
    assert str(err.value) == message


def test_flag_named_in_error() -> None:
    with pytest.raises(SettingsError, match=r"^--metrics-port is 'no'"):
        load_settings(["--metrics-port", "no"], {})


def test_operator_main_reports_bad_settings(capsys: pytest.CaptureFixture[str]) -> None:
    from pstrain_operator.main import operator_main

    assert operator_main(["--log-level", "loud"]) == 2
    assert "--log-level is 'loud'" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "env", "seconds"), [
    ([], {}, 60),
    ([], {"PSTRAIN_OPERATOR_PS_LIVENESS_SECONDS": "0"}, 0),
    (["--ps-liveness-seconds", "120"], {"PSTRAIN_OPERATOR_PS_LIVENESS_SECONDS": "0"}, 120),
])
def test_the_ps_liveness_window_reaches_the_pod_builder(argv: list[str], env: dict[str, str],
                                                        seconds: int) -> None:
    settings = load_settings(argv, env)
    assert settings.ps_liveness_seconds == seconds
    assert settings.pods.ps_liveness_seconds == seconds
