"""Storage URLs as users write them: ``report`` and ``pick`` read a bare ``postgresql://`` URL
(SQLAlchemy 2.1 maps it to psycopg 3, which is not installed: the sweeper already wrote such studies
through psycopg2), ``pick`` has the ``--study`` its message tells users to pass, and no piece of a password
with an unencoded ``@`` is printed."""

from __future__ import annotations

import pytest

from vramsweep.cli import main
from vramsweep.report.load import safe_url
from vramsweep.sweeper.settings import mask_secret, mask_url

PW_URL = "postgresql://vramsweep:top@secret@127.0.0.1:1/postgres"  # an unencoded '@' in the password
FAKE = ["hydra.sweeper.trial_fn=fakes:fake_trial", "hydra.sweeper.isolation=inprocess", "adapter.r=8,16"]


@pytest.mark.parametrize("mask", [mask_url, safe_url])
def test_masking_hides_the_whole_password(mask):
    assert mask(PW_URL) == "postgresql://vramsweep:***@127.0.0.1:1/postgres"
    assert mask("postgresql://u:p@h/db") == "postgresql://u:***@h/db"
    assert mask("postgresql://h:5432/db") == "postgresql://h:5432/db"
    assert mask("sqlite:////tmp/a@b/study.db") == "sqlite:////tmp/a@b/study.db"


def test_a_drivers_message_loses_every_piece_of_the_password():
    """SQLAlchemy takes ``top`` for the password and ``secret@127.0.0.1`` for the host."""
    text = (
        'could not translate host name "secret@127.0.0.1" to address; password "top" (user vramsweep:top@x)'
    )
    out = mask_secret(text, PW_URL)
    assert "secret" not in out and ":top@" not in out and "127.0.0.1" in out


@pytest.mark.parametrize("verb", ["train", "report", "pick"])
def test_an_unencoded_password_is_never_printed(tmp_path, capsys, monkeypatch, verb):
    monkeypatch.chdir(tmp_path)
    argv = {
        "train": ["train", "-m", *FAKE, f"hydra.sweeper.storage={PW_URL}", f"results_dir={tmp_path}/r"],
        "report": ["report", PW_URL],
        "pick": ["pick", PW_URL, "--budget-gib", "1", "--config-dir", str(tmp_path / "uc")],
    }[verb]
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2, err
    assert "vramsweep:***@127.0.0.1" in err, err
    assert "secret" not in out + err and "top" not in out + err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_pick_has_study(capsys):
    with pytest.raises(SystemExit):
        main(["pick", "--help"])
    assert "--study" in capsys.readouterr().out


@pytest.mark.postgres
def test_report_and_pick_read_a_bare_postgresql_url(pg_url, tmp_path, capsys, monkeypatch):
    assert pg_url.startswith("postgresql://")
    monkeypatch.chdir(tmp_path)
    for name in ("bare_a", "bare_b"):  # two studies: the target needs --study
        argv = ["train", "-m", *FAKE, f"hydra.sweeper.study_name={name}", f"hydra.sweeper.storage={pg_url}"]
        assert main([*argv, f"results_dir={tmp_path}/r"]) == 0
    capsys.readouterr()
    assert main(["report", pg_url]) == 2
    assert "holds several studies; pick one with --study" in capsys.readouterr().err
    assert main(["report", pg_url, "--study", "bare_a"]) == 0, capsys.readouterr().err
    uc = tmp_path / "uc"
    code = main(["pick", pg_url, "--study", "bare_b", "--budget-gib", "1", "--config-dir", str(uc)])
    assert code == 0, capsys.readouterr().err
    assert (uc / "experiment" / "bare_b_1gib.yaml").is_file()
    assert main(["pick", pg_url, "--study", "nope", "--budget-gib", "1", "--config-dir", str(uc / "x")]) == 2
    assert "unknown study 'nope'" in capsys.readouterr().err and not (uc / "x").exists()
