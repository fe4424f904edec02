"""
The machine a run uses: its device, how many CPU threads, whether the step is compiled, and the
checks of those flags that every script shares before any weights load, and how a script ends
when it cannot go on (run_script).
"""
import argparse
import os
import resource
import sys
import time
from pathlib import Path

import torch

from engine import linear_forms as LF
from engine.files import os_error_text
from engine.rows_apart import ROWS_APART_MAX
from model import CheckpointError


def run_script(main, interrupted: str = "interrupted"):
    """A script's main() as its command line runs it: what a user can act on (a checkpoint or
    value refused, a file that cannot be read or written) ends in one line, `error: ...`, and exit
    status 1; Ctrl-C in the line `interrupted` (what was kept, and how to go on) and status 130.
    Never a traceback for either."""
    try:
        main()
    except (CheckpointError, ValueError) as e:
        sys.exit(f"error: {e}")
    except OSError as e:
        sys.exit(f"error: {os_error_text(e)}")
    except KeyboardInterrupt:
        print(interrupted, file=sys.stderr)
        sys.exit(130)


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help with each option's default, but none for a default of None: such an option's help
    says what leaving it out does, and "(default: None)" would contradict it."""

    def _get_help_string(self, action):
        # (nor for a flag, whose default is its absence, nor where the help already names it)
        if action.default is None or isinstance(action.default, bool) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class ArgumentParser(argparse.ArgumentParser):
    """argparse with errors in one line: a script of many options would print its whole usage,
    dozens of lines, before the one that says what is wrong. With argv given, --help shows what a
    user types first and --help-all every option: more_options() groups are left out of --help."""

    def __init__(self, *args, argv=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.shows_all = argv is None or "--help-all" in argv
        self.lister = "--help" if argv is None else "--help-all"
        if argv is not None:
            self.add_argument("--help-all", action="help", help="show every option and exit")

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} ({self.lister} lists every option)\n")

    def more_options(self, title: str):
        """An argument group that --help-all shows and --help leaves out."""
        group = self.add_argument_group(title)
        return group if self.shows_all else HiddenGroup(group)


class HiddenGroup:
    """An argument group whose options parse as usual but have no help (argparse then leaves them
    out of usage and help alike)."""

    def __init__(self, group):
        self.group = group

    def add_argument(self, *args, **kwargs):
        return self.group.add_argument(*args, **{**kwargs, "help": argparse.SUPPRESS})


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def idle_cores(seconds: float = 0.25) -> float | None:
    """How many cores the rest of the machine leaves idle right now (Linux /proc/stat); None where
    that cannot be read."""
    def sample():
        fields = [float(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return fields[3] + fields[4], sum(fields[:8])  # idle + iowait, all
    try:
        idle0, total0 = sample()
        time.sleep(seconds)
        idle1, total1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    return (os.cpu_count() or 1) * (idle1 - idle0) / max(total1 - total0, 1e-9)


def machine_is_quiet() -> bool:
    """Whether every core is idle right now: a timing made otherwise is used but never kept."""
    idle = idle_cores()
    return idle is not None and idle >= (os.cpu_count() or 1) - 0.5


def pick_threads(flag: str) -> int:
    """--threads N, or auto: one per core that nothing else is using. OpenMP threads spin while they
    wait for each other, so a thread that shares its core with a busy process stalls them all."""
    if flag != "auto":
        return max(1, int(flag))
    idle = idle_cores()
    return torch.get_num_threads() if idle is None else max(1, min(torch.get_num_threads(), round(idle)))


def start_processes(device: str):
    """(device, rank, world): one process, or one of several launched by torchrun (DDP)."""
    if "RANK" not in os.environ:
        return device, 0, 1
    import torch.distributed as dist
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    if device.startswith("cuda"):
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
        torch.cuda.set_device(device)
    return device, dist.get_rank(), dist.get_world_size()


def wall_clock(device: str):
    """The clock runs are timed with: seconds on the wall, read after the device's queued work is
    done (on CUDA a kernel returns at launch), so a timing measures the work."""
    if not str(device).startswith("cuda"):
        return time.perf_counter
    target = torch.device(device)

    def clock():
        torch.cuda.synchronize(target)
        return time.perf_counter()
    return clock


def wants_compile(flag: str, device: str) -> bool:
    """--compile auto|on|off: auto compiles on CUDA only. On a CPU the first run compiles for
    minutes, and compiled kernels round otherwise than eager ones, so a default that compiled once
    graphs were kept would print other text than before (docs/compiled)."""
    return flag == "on" or (flag == "auto" and device.startswith("cuda"))


def compiled_draft_problem(k: int, tree: bool, flag: str = "--tree") -> str | None:
    """Why a compiled run cannot verify what it would draft, or None. Compiled runs verify chains in
    one static block shape (a tree's mask and moves are its own, and an eager tree would part from
    the compiled steps' bits); a block of more than ROWS_APART_MAX tokens attends in one call, so
    its rows never give the compiled steps' bits. flag: how the command line asks for a tree."""
    if tree:
        return f"{flag} needs --compile off: compiled runs verify chains, one static block shape"
    if k + 1 > ROWS_APART_MAX:
        return (f"--compile on verifies blocks of up to {ROWS_APART_MAX} tokens (-k up to {ROWS_APART_MAX - 1}): "
                "the rows of a longer one attend together and part from the compiled steps' bits")
    return None


def unpack(model: torch.nn.Module) -> torch.nn.Module:
    """Swap every PackedLinear back for an nn.Linear of its dtype (in place): torch.compile cannot
    read oneDNN's blocked tensors."""
    for module in [m for m in model.modules() if any(type(c) is LF.PackedLinear for c in m.children())]:
        for name, child in list(module.named_children()):
            if type(child) is LF.PackedLinear:
                weight = LF.dense_weight(child)
                linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=child.bias is not None,
                                         device="meta", dtype=weight.dtype)
                linear.weight = torch.nn.Parameter(weight, requires_grad=False)
                if child.bias is not None:
                    linear.bias = torch.nn.Parameter(child.bias, requires_grad=False)
                setattr(module, name, linear)
    return model


def machine_problem(device: str, threads: str, dtype: str | None, compiled: bool = False) -> str | None:
    """What is wrong with --device, --threads and --dtype together (decode.py, bench.py and
    lossy.py check them alike, before any weights load), or None."""
    if device != "cpu" and not device.startswith("cuda"):
        return f"--device takes cpu, cuda or cuda:N, got {device!r}"
    if device.startswith("cuda"):
        index = device.partition(":")[2]
        if not torch.cuda.is_available():
            return f"--device {device}: this machine has no CUDA device (torch {torch.__version__}); use --device cpu"
        if index and not (index.isdigit() and int(index) < torch.cuda.device_count()):
            return f"--device {device}: there are {torch.cuda.device_count()} CUDA devices (cuda:0 ...)"
    cores = os.cpu_count() or 1
    if threads != "auto" and not (threads.isdigit() and 1 <= int(threads) <= cores):
        return f"--threads takes auto or a whole number from 1 to the {cores} cores here, got {threads}"
    if dtype in ("int8", "int4") and device != "cpu":
        return f"--dtype {dtype} runs on the CPU; use bfloat16 on a GPU"
    if dtype == "int8" and compiled:
        return "--dtype int8 runs uncompiled (only int4's compiled blocks are tested exact); use int4 or --compile off"

    return None


def reset_peak_memory(device: str):
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:  # Linux: writing 5 to clear_refs restarts the resident-set high-water mark (VmHWM)
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass  # elsewhere the figure is the process's peak so far


def peak_memory_mb(device: str) -> float:
    """Peak device memory allocated (CUDA), or the process's peak resident set (CPU), in MiB."""
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated(device) / 2**20
    status = Path("/proc/self/status")
    for line in status.read_text().splitlines() if status.is_file() else []:
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# The machine options every script that runs the target shares, declared once. Their values are
# checked together by machine_problem, before any weights load.
MACHINE_OPTIONS = {
    "device": dict(default=None, help="cpu, cuda or cuda:N (default: cuda where there is one, else cpu)"),
    "dtype": dict(default="auto", choices=("auto", "float32", "bfloat16", "float16", "int8", "int4"),
                  help="the target's weights. auto (default): one layout for the whole run, the one whose "
                       "one-token step was timed fastest here (bf16 on CUDA; README: weight layouts); int8 and "
                       "int4 change the model a little"),
    "compile": dict(default="auto", choices=("auto", "on", "off"),
                    help="torch.compile the step, the verification block and an EAGLE-3 draft's row; auto: on CUDA "
                         "only, since on a CPU a first run compiles for minutes and prints other text than eager "
                         "(docs/compiled)"),
    "threads": dict(default="auto", help="CPU threads; auto: one per core idle at the start (a thread on a busy "
                                         "core stalls the others: time with nothing else running)"),
}


def add_machine_options(group, *names: str):
    """Declare the named MACHINE_OPTIONS (--device, --dtype, --compile, --threads) on an argparse
    group; --device's default is resolved here, where the script starts."""
    for name in names:
        options = dict(MACHINE_OPTIONS[name])
        if name == "device":
            options["default"] = default_device()
        group.add_argument(f"--{name}", **options)
