"""How a command ends: one line for a user's mistake (exit 2), for an operational failure (exit 1) and for Ctrl-C or
SIGTERM (exit 130), a traceback only for a bug; under torchrun, one line on rank 0 and a quick exit everywhere.

This is what `train.py` and `eval.py` (and every module that checks a user's input) raise and how the command line
reports it.
"""
from __future__ import annotations

import os
import re
import signal
import sys


class UserError(ValueError):
    """A mistake in the command, the config or the inputs. The command line prints `error: <message>` (one line, no
    traceback) and exits with code 2; a bug keeps its traceback."""
    exit_code = 2


class RunFailure(UserError):
    """The run cannot go on for an operational reason (disk full, a backend down): one line, exit code 1."""
    exit_code = 1


class Interrupted(UserError):
    """Ctrl-C (SIGINT) or SIGTERM: one line saying what was kept and how to continue, exit code 130."""
    exit_code = 130


STOP = {"signal": None}              # the SIGINT / SIGTERM that is stopping this process (set by run_cli), if any


def stop_requested() -> bool:
    """Whether Ctrl-C or SIGTERM has asked this process to stop (an error raised meanwhile is part of stopping)."""
    return STOP["signal"] is not None


def run_cli(main, argv=None) -> int:
    """Run a command's main(argv) and return its exit code: a UserError becomes one line `error: ...` on stderr (rank
    0 only); Ctrl-C or SIGTERM one line `interrupted: ...` (what was kept, how to continue; main raises Interrupted
    with it) and code 130. A process that lost its peers (another rank stopped) says so in one line. With a process
    group the process then ends at once (os._exit): a collective or a tool call in flight would otherwise hold it."""
    stop = STOP
    stop["signal"] = None

    def on_signal(signum, frame):                # the first SIGINT/SIGTERM interrupts, later ones only count
        first = stop["signal"] is None
        stop["signal"] = signum
        if first:
            raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    rank = os.environ.get("RANK", "0")
    code = 0
    try:
        main(argv)
    except Interrupted as err:
        stop["signal"] = stop["signal"] or signal.SIGINT
        code = _say(rank, f"interrupted: {err}", err.exit_code)
    except UserError as err:
        code = _say(rank, f"error: {err}", err.exit_code)
    except KeyboardInterrupt:
        stop["signal"] = stop["signal"] or signal.SIGINT
        code = _say(rank, "interrupted", Interrupted.exit_code)
    except (SystemExit, GeneratorExit):
        raise
    except BaseException as err:                 # noqa: BLE001 -- a peer's failure, a signal mid-collective (torch's
                                                 # checkpoint errors are BaseExceptions)
        if stop["signal"] is None and not lost_peer(err):
            raise                                # a bug: keep its traceback
        code = Interrupted.exit_code if stop["signal"] else 1
        _say("0", f"{'interrupted' if stop['signal'] else 'error'}: rank {rank} stopped because another process "
                  f"stopped ({' '.join(str(err).split())[:120]})", code)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if code and "torch.distributed" in sys.modules and sys.modules["torch.distributed"].is_initialized():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _say(rank: str, line: str, code: int) -> int:
    """Print `line` on rank 0 after closing the progress bars still open, so it stands alone as the last line."""
    if "tqdm" in sys.modules:
        for bar in list(getattr(sys.modules["tqdm"].tqdm, "_instances", ())):
            bar.close()
    if rank == "0":
        print(for_console(line), file=sys.stderr, flush=True)
    return code


def for_console(text: str) -> str:
    """`text` without the bidirectional controls (U+202A-U+202E embeddings and overrides, U+2066-U+2069 isolates),
    which make a terminal show the characters after them in another order than they are: a file name, a data row or
    a tool's output quoted in a console line cannot make it read as something else."""
    return re.sub("[\u202a-\u202e\u2066-\u2069]", "", text)


def lost_peer(err: BaseException) -> bool:
    """Whether `err` is a collective failing because another process went away (gloo / nccl wording)."""
    text = str(err).lower()
    return any(words in text for words in ("connection reset by peer", "connection closed by peer", "broken pipe",
                                           "connection refused", "socket closed", "nccl communicator was aborted"))
