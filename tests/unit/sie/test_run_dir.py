"""The run directory holds the control plane's signing key, the tokens and the state file whose pids `sie
down` signals, on a machine that may run other users' software (DESIGN §10). It is used only when it is
this user's alone, files are never written through a link someone left there, and a secret another user
owns is not believed."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from sie.auth import CredentialDir, CredentialError, read_secret, write_private
from sie.auth.store import UnsafeDirectory, dir_problem, link_problem, parent_problem, private_dir
from sie.auth.tokens import Signer
from sie.cluster import ClusterSettings
from sie.run_dir import STATE_FILE, stop_running
from sie.standalone import Stack

ME, ROOT, OTHER = 1000, 0, 1001
NOBODY = 65534  # another local user, for the checks only root can set up (chown)
as_root = pytest.mark.skipif(os.getuid() != 0, reason="only root can give a file to another user")
SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


def fake_stat(mode: int, uid: int) -> os.stat_result:
    return os.stat_result((mode, 0, 0, 1, uid, 0, 0, 0, 0, 0))


DIR, LINK, FILE = stat.S_IFDIR, stat.S_IFLNK, stat.S_IFREG


@pytest.mark.parametrize(
    "mode, uid, why",
    [
        (DIR | 0o700, ME, None),
        (DIR | 0o755, ME, None),  # readable only: made 0700 by private_dir
        (DIR | 0o777, ME, "others may write"),
        (DIR | 0o770, ME, "others may write"),
        (DIR | 0o1777, ME, "others may write"),  # sticky protects its entries' names, not what goes in
        (DIR | 0o700, OTHER, "belongs to uid 1001, not to you"),
        (DIR | 0o700, ROOT, "belongs to uid 0, not to you"),
        (LINK | 0o777, ME, "symbolic link"),
        (FILE | 0o600, ME, "not a directory"),
    ],
)
def test_the_run_directory_itself_must_be_a_real_directory_of_this_user_that_nobody_else_may_write(mode, uid, why):
    problem = dir_problem(Path("/x/run"), fake_stat(mode, uid), ME, "run directory")
    assert problem is None if why is None else why in (problem or "")


@pytest.mark.parametrize(
    "mode, uid, why",
    [
        (DIR | 0o755, ME, None),
        (DIR | 0o755, ROOT, None),
        (DIR | 0o1777, ROOT, None),  # /tmp: only the owner of an entry may rename or remove it
        (DIR | 0o777, ROOT, "others may write"),
        (DIR | 0o775, ME, "others may write"),
        (DIR | 0o700, OTHER, "belongs to uid 1001"),
        (DIR | 0o1777, OTHER, "belongs to uid 1001"),
    ],
)
def test_a_directory_above_it_must_not_let_another_user_replace_it(mode, uid, why):
    problem = parent_problem(Path("/x"), fake_stat(mode, uid), ME, Path("/x/run"))
    assert problem is None if why is None else why in (problem or "")


@pytest.mark.parametrize("uid, why", [(ME, None), (ROOT, None), (OTHER, "symbolic link of uid 1001")])
def test_a_link_on_the_way_must_be_this_users_or_roots(uid, why):
    problem = link_problem(Path("/x"), fake_stat(LINK | 0o777, uid), ME, Path("/x/run"))
    assert problem is None if why is None else why in (problem or "")


def test_a_missing_run_directory_is_made_0700_with_every_missing_parent(tmp_path):
    run = private_dir(tmp_path / ".sie" / "run", "run directory")
    assert run == tmp_path / ".sie" / "run"
    for made in (run, run.parent):
        assert stat.S_IMODE(made.lstat().st_mode) == 0o700 and made.lstat().st_uid == os.getuid()


@pytest.mark.parametrize("mode", [0o777, 0o770])
def test_a_run_directory_others_may_write_is_refused_and_left_as_it_is(tmp_path, mode):
    run = tmp_path / "run"
    run.mkdir()
    run.chmod(mode)
    with pytest.raises(UnsafeDirectory, match=r"others may write to the run directory .*rm -rf"):
        private_dir(run, "run directory")
    assert stat.S_IMODE(run.stat().st_mode) == mode


def test_a_run_directory_inside_one_others_may_write_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # not sticky: anyone may rename .sie away and put their own in its place
    with pytest.raises(UnsafeDirectory, match="chmod go-w"):
        private_dir(shared / ".sie" / "run", "run directory")


def test_a_symlinked_run_directory_is_refused(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    (tmp_path / "run").symlink_to(mine)
    with pytest.raises(UnsafeDirectory, match="symbolic link"):
        private_dir(tmp_path / "run", "run directory")


def test_a_run_directory_of_another_user_is_refused_by_the_owner_check_alone(tmp_path):
    """As another uid than the directory's (the check takes the uid to hold it to, as root would chown)."""
    run = private_dir(tmp_path / "run", "run directory")
    with pytest.raises(UnsafeDirectory, match=f"belongs to uid {os.getuid()}"):
        private_dir(run, "run directory", me=os.getuid() + 1)


@as_root
def test_a_run_directory_another_user_prepared_in_a_shared_directory_is_refused(tmp_path):
    """The reviewer's case: in a 1777 directory, the other user made .sie/run 0777 and put a signing key in."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    run = shared / ".sie" / "run"
    (run / "credentials").mkdir(parents=True)
    Path(run / "credentials" / "signing.key").write_bytes(Signer.generate().private_pem())
    for path in (run.parent, run, run / "credentials", run / "credentials" / "signing.key"):
        os.chown(path, NOBODY, NOBODY)
    with pytest.raises(UnsafeDirectory, match=f"belongs to uid {NOBODY}"):
        private_dir(run, "run directory")
    with pytest.raises(UnsafeDirectory, match=f"belongs to uid {NOBODY}"):
        CredentialDir(run / "credentials").ensure(nodes=("local",))
    assert not (run / "credentials" / "trust.pem").exists()


@as_root
def test_a_signing_key_another_user_owns_is_not_trusted(tmp_path):
    creds = CredentialDir(tmp_path / "credentials").ensure()
    os.chown(creds.file("signing.key"), NOBODY, NOBODY)
    with pytest.raises(CredentialError, match=f"belongs to uid {NOBODY}"):
        creds.signer()


def test_a_secret_of_another_user_is_refused(tmp_path):
    path = tmp_path / "admin.token"
    write_private(path, b"abc")
    assert read_secret(path) == "abc"
    me = os.getuid() + 1
    if os.getuid() == 0:  # root's files are trusted by everyone: give it to someone else
        os.chown(path, NOBODY, NOBODY)
        me = 0
    with pytest.raises(CredentialError, match="belongs to uid .*, not to you"):
        read_secret(path, me=me)


def test_write_private_never_writes_through_a_link_left_in_the_directory(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    folder = private_dir(tmp_path / "run", "run directory")
    target = folder / "admin.token"
    # Whatever temporary name a writer might pick, and the target itself, point at the victim.
    for name in (f".{target.name}.{os.getpid()}.tmp", f"{target.name}.tmp", target.name):
        (folder / name).symlink_to(victim)
    write_private(target, b"secret")
    assert victim.read_text() == "precious"
    assert not target.is_symlink() and target.read_bytes() == b"secret"
    assert stat.S_IMODE(target.stat().st_mode) == 0o600


def test_the_state_file_is_never_written_through_a_link_left_in_the_run_directory(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    run = private_dir(tmp_path / "run", "run directory")
    (run / f"{STATE_FILE}.tmp").symlink_to(victim)
    Stack(tmp_path / "cluster.yaml", ClusterSettings(), run).write_state()
    assert victim.read_text() == "precious"
    assert json.loads((run / STATE_FILE).read_text())["pid"] == os.getpid()
    assert stat.S_IMODE((run / STATE_FILE).stat().st_mode) == 0o600


def test_sie_down_does_not_signal_a_pid_named_in_a_run_directory_others_may_write(tmp_path):
    stranger = subprocess.Popen(SLEEPER)
    try:
        run = tmp_path / "run"
        run.mkdir()
        run.chmod(0o777)
        (run / STATE_FILE).write_text(json.dumps({"pid": stranger.pid, "children": {}}))
        with pytest.raises(UnsafeDirectory, match="others may write"):
            stop_running(run, timeout_s=2, log=lambda _line: None)
        assert stranger.poll() is None
    finally:
        stranger.kill()
        stranger.wait()


def test_a_run_directory_that_cannot_be_made_says_so(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(CredentialError, match=r"cannot make sure the run directory .* is yours alone: Not a directory"):
        private_dir(tmp_path / "file" / "run", "run directory")
