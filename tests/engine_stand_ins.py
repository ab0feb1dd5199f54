"""Stand-ins for an engine class that ``dha_train.engine_process.EngineProcess`` builds in a child process: one whose
native code crashes, as llama.cpp's did on AMX CPUs. Module-level classes, so that a spawned child imports them."""

from __future__ import annotations

import os
import signal

from dha_train.llama_cpp_engine import LlamaCppSequences


class CrashingEngine:
    """Answers ``echo``; ``crash`` kills its own process by ``signal_number`` (a segfault or abort in native code)."""

    def __init__(self, greeting: str = 'ready'):
        self.greeting = greeting

    def echo(self, value):
        return value

    def refuse(self, message: str):
        raise ValueError(message)

    def crash(self, signal_number: int = signal.SIGSEGV):
        os.kill(os.getpid(), signal_number)


class SequencesCrashingOnMla(LlamaCppSequences):
    """``LlamaCppSequences``, whose engine segfaults at its first decoding step for a file named ``MLA-...``."""

    def decode(self, *args, **kwargs):
        if self.path.name.startswith('MLA'):
            os.kill(os.getpid(), signal.SIGSEGV)
        return super().decode(*args, **kwargs)
