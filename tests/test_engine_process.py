"""``EngineProcess``: an engine built in a child process of its own, so that a crash of its native code is an error
naming the signal in the caller (the test, ``bench serve``), not the end of the caller's process."""

from __future__ import annotations

import signal

import pytest

from dha_train.engine_process import EngineCrashedError, EngineProcess, death
from engine_stand_ins import CrashingEngine


def test_calls_attributes_and_errors_travel_through_the_child():
    with EngineProcess(CrashingEngine, greeting='hello') as engine:
        assert engine.greeting == 'hello'
        assert engine.echo({'a': [1, 2]}) == {'a': [1, 2]}
        with pytest.raises(ValueError, match='no such thing'):
            engine.refuse('no such thing')
        assert engine.echo(3) == 3  # the child serves on after an exception


@pytest.mark.parametrize('signal_number', [signal.SIGSEGV, signal.SIGABRT])
def test_a_crash_in_the_child_is_an_error_naming_the_signal_and_the_call(signal_number):
    engine = EngineProcess(CrashingEngine)
    with pytest.raises(EngineCrashedError, match=f'signal {signal.Signals(signal_number).name}.*crash of CrashingEngine'):
        engine.crash(signal_number)
    with pytest.raises(EngineCrashedError, match=signal.Signals(signal_number).name):
        engine.echo(1)  # the child is gone: every later call says so
    engine.close()


def test_a_constructor_that_raises_raises_in_the_caller():
    with pytest.raises(TypeError):
        EngineProcess(CrashingEngine, 'a', 'b')


def test_death_in_words():
    assert death(-11) == 'signal SIGSEGV (11)' and death(1) == 'exit code 1' and death(None) == 'no exit (hung)'
