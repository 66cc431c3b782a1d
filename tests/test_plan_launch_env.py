"""plan under torchrun's variables plans the rank and world size run would take from them."""

from pipeline.cli import main

BASE = ["plan", "--device-profile", "h200", "--installed", "torch,triton,flashinfer"]
LAUNCH = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def test_plan_takes_world_size_from_the_launch(monkeypatch, capsys):
    for k, v in LAUNCH.items():
        monkeypatch.setenv(k, v)
    rc = main(BASE + ["--tp-size", "4"])
    err = " ".join(capsys.readouterr().err.split())
    assert rc != 0 and "conflicting_options" in err and "--world-size 2" in err, (rc, err)
    assert main(BASE + ["--tp-size", "2"]) == 0, capsys.readouterr()


def test_an_explicit_world_size_is_kept_under_the_launch(monkeypatch, capsys):
    for k, v in LAUNCH.items():
        monkeypatch.setenv(k, v)
    assert main(BASE + ["--tp-size", "4", "--world-size", "4"]) == 0, capsys.readouterr()
