"""`Stage.run(isolated=True)`: the build runs in a fresh process and its result comes back through the marker."""

import os

import pytest
import torch

from dha_train.stages import Stage


def _say(message: str) -> None:
    print(message)


def test_isolated_stage_runs_in_its_own_process_and_is_reused(tmp_path):
    # the parent has run multi-threaded torch first: a forked child would hang here, a fresh process does not
    weights = torch.randn(256, 256)
    expected = float((weights @ weights).sum())
    parent = os.getpid()

    def build(folder):
        (folder / 'made.txt').write_text('x')
        return {'pid': os.getpid(), 'value': float((weights @ weights).sum()),  # the closure travels
                'run_folder': sorted(path.name for path in folder.parent.iterdir())}

    result = Stage(tmp_path, 'square').run(lambda out: (out.mkdir(parents=True), build(out))[1], _say, isolated=True)
    assert result['pid'] != parent
    assert result['value'] == pytest.approx(expected, rel=1e-5)
    assert (tmp_path / 'square' / 'made.txt').is_file() and 'seconds' in result
    # the closure reached the child through a pipe: while it ran, the run folder held no payload file to plant or swap
    assert result['run_folder'] == ['square']

    def must_not_run(folder):
        raise AssertionError('a finished stage was built again')

    assert Stage(tmp_path, 'square').run(must_not_run, _say, isolated=True) == result


def test_isolated_stage_failure_names_the_stage_and_leaves_no_marker(tmp_path, capfd):
    def build(folder):
        raise ValueError('calibration data is empty')

    with pytest.raises(RuntimeError, match='stage broken failed in its own process'):
        Stage(tmp_path, 'broken').run(build, _say, isolated=True)
    assert 'calibration data is empty' in capfd.readouterr().err
    assert Stage(tmp_path, 'broken').done() is None
    assert not list(tmp_path.glob('.*.build.pkl'))
