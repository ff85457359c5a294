"""torchdiagnose's words (torchdiagnose.lines), each function on its own: what the ranks report goes in, the line's
words come out, with no job. The jobs that produce these reports: test_diagnose.py, test_diagnose_parallel.py,
test_diagnose_installed.py, test_hangs.py.
"""
import signal
from pathlib import Path
from traceback import FrameSummary

import torch

from conftest import REPO
from torchdiagnose import lines, names

ENTRY = {"process_group": ("4", "mesh_tp"), "collective_seq_id": 37, "profiling_name": "gloo:all_gather",
         "input_sizes": [[16, 8, 32]]}


def test_one_line_and_short_error_keep_a_message_short_and_on_one_line():
    assert lines.one_line("a\n  b\tc") == "a b c"
    assert lines.one_line(ValueError()) == "ValueError"
    assert lines.one_line("x" * 400) == "x" * 300 + "..."
    gloo = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
            "[127.0.0.1]:3712. This is typically caused by a remote worker crashing. Exception raised from x at y")
    assert lines.short_error(gloo) == "Connection closed by peer [127.0.0.1]:3712"


def test_lost_peer_finds_the_collectives_error_under_a_wrapper():
    cause = RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:1")
    try:
        try:
            raise cause
        except RuntimeError as error:
            raise RuntimeError("[Stage 0] failed to run forward") from error  # a pipeline stage's own
    except RuntimeError as wrapper:
        assert lines.lost_peer(wrapper) is cause
    assert lines.lost_peer(ValueError("a bad flag")) is None
    assert lines.lost_peer(torch.distributed.DistError("any")) is not None


def test_mismatch_reads_both_sides_of_debug_details_message():
    text = ("Detected mismatch between collectives on ranks. Rank 0 is running collective: CollectiveFingerPrint("
            "SequenceNumber=7, OpType=ALLGATHER, TensorShape=[2], TensorDtypes=Float)). Rank 1 is running collective: "
            "CollectiveFingerPrint(SequenceNumber=7, OpType=ALLREDUCE, TensorShape=[1409], TensorDtypes=Float)). "
            "Collectives differ in the following aspects: Op type: ALLGATHERvsALLREDUCE")
    found = lines.mismatch(text)
    assert found["sides"] == {"0": {"seq": "7", "what": "all_gather of [2] (Float)"},
                              "1": {"seq": "7", "what": "all_reduce of [1409] (Float)"}}, found
    assert found["aspects"].startswith("Op type: ALLGATHER"), found
    assert lines.mismatch("Connection reset by peer") is None


def test_describe_entry_and_group_text_name_a_meshs_group_by_its_dimension_and_ranks():
    entry = lines.describe_entry(ENTRY, 7.0)
    assert entry == {"seq": 37, "kind": "all_gather", "shapes": "[16, 8, 32]", "group": "mesh_tp", "group_name": "4",
                     "waited": 7.0}
    assert lines.group_text(dict(entry, ranks=[2, 3])) == "tp group [2, 3]"
    assert lines.group_text(dict(entry, group="undefined", ranks=[0, 2])) == "group [0, 2]"
    assert lines.group_text(dict(entry, group="default_pg", ranks=[0, 1])) is None
    assert lines.group_text(entry) is None  # no ranks known
    many = lines.describe_entry(dict(ENTRY, input_sizes=[[1], [2], [3], [4]]))
    assert many["shapes"] == "[1], [2], [3], ..."


def test_describe_entry_names_a_reduce_scatter_that_gloo_records_as_an_all_reduce():
    # As torch 2.13's gloo records FSDP2's reduce-scatter of gradients: an all_reduce of the whole input, whose
    # stack (innermost first) starts in reduce_scatter_single.
    c10d = str(Path(torch.__file__).parent / "distributed" / "distributed_c10d.py")
    stack = [{"filename": c10d, "name": "reduce_scatter_single", "line": 4910},
             {"filename": str(Path(torch.__file__).parent / "distributed" / "c10d_logger.py"), "name": "wrapper"},
             {"filename": "/home/me/train.py", "name": "step", "line": 80}]
    entry = dict(ENTRY, profiling_name="gloo:all_reduce", input_sizes=[[8224]], frames=stack)
    assert lines.issued_by(entry) == "reduce_scatter_single"
    assert lines.describe_entry(entry)["kind"] == "reduce_scatter"
    assert lines.describe_entry(entry)["shapes"] == "[8224]"  # the input: the whole gradients
    # A real all_reduce stays one, as does an entry read without its stack (the watchdog's look).
    stack[0]["name"] = "all_reduce"
    assert lines.describe_entry(entry)["kind"] == "all_reduce"
    assert lines.issued_by(ENTRY) is None and lines.describe_entry(dict(ENTRY, frames=[]))["kind"] == "all_gather"


def test_fsdp_names_the_collectives_module_its_gradients_and_the_root():
    # parallel.origin's words for FSDP2's collectives (nd_parallel.py's real ones: test_diagnose_parallel.py).
    assert lines.fsdp("layers.1") == "FSDP of layers.1"
    assert lines.fsdp("layers.1", gradients=True, backward=True) == "FSDP's gradients of layers.1 in backward()"
    assert lines.fsdp("layers.0", backward=True) == "FSDP of layers.0 in backward()"  # gathered again for backward
    assert lines.fsdp("", "Decoder", gradients=True) == "FSDP's gradients of the root module (Decoder)"
    assert lines.fsdp("") == "FSDP of the root module"
    assert lines.fsdp("a, b") == "FSDP of a and b"  # fully_shard([a, b]): one unit of two modules
    assert lines.fsdp(None) == "FSDP" and lines.fsdp(None, gradients=True) == "FSDP's gradients"  # module unknown
    entry = dict(lines.describe_entry(ENTRY), origin=lines.fsdp("layers.1"))
    assert lines.collective(entry, {"where": "nd.py:137", "model": "model.py:225 in forward"}) == \
        "#37 (all_gather of [16, 8, 32], FSDP of layers.1 at nd.py:137 via model.py:225 in forward)"


def test_ranks_text():
    assert lines.ranks_text([3]) == "rank 3"
    assert lines.ranks_text([2, 0, 1]) == "ranks 0, 1, 2"


def test_process_state_says_stopped_gone_or_in_a_debugger():
    where = {"pid": 7, "host": "n1"}
    assert lines.process_state(dict(where, exit=-signal.SIGKILL)) == "killed by SIGKILL (pid 7, on n1)"
    assert lines.process_state(dict(where, exit=3)) == "exited with code 3 (pid 7, on n1)"
    assert lines.process_state(dict(where, state="T", stop_signal="SIGTSTP")) == \
        "stopped by SIGTSTP (pid 7, on n1): it runs nothing until it gets SIGCONT"
    assert lines.process_state(dict(where, state="T")).startswith("stopped (pid 7, on n1; SIGSTOP, or Ctrl-Z")
    assert lines.process_state(dict(where, state="t", tracer=9)) == "stopped in a debugger (pid 9) (pid 7, on n1)"
    assert lines.process_state(dict(where, state=None, local=True)).startswith("its process ended (pid 7, on n1")
    assert lines.process_state(dict(where, state="S")) is None  # alive: what it does, the rank's own answer says


def test_model_site_and_phase_site_the_models_line_and_the_call_that_names_a_phase():
    script, model = str(REPO / "x" / "train.py"), str(REPO / "x" / "model.py")
    library = str(Path(torch.__file__).parent / "nn" / "functional.py")
    frames = [FrameSummary(script, 90, "<module>"), FrameSummary(model, 20, "forward"),
              FrameSummary(library, 2910, "layer_norm")]
    assert lines.model_site(frames, script=script).endswith("model.py:20 in forward")
    assert lines.model_site(frames[:1], script=script) is None
    assert not lines.in_backward(frames)
    evaluation = [FrameSummary(script, 90, "<module>"), FrameSummary(script, 70, "main"),
                  FrameSummary(script, 41, "evaluate"), FrameSummary(model, 20, "forward")]
    assert lines.phase_site(evaluation, script=script) == f"evaluate(), called at {lines.shown(script)}:70"
    assert lines.phase_site(frames, script=script) is None  # at the script's top level
    engine = str(Path(torch.__file__).parent / "autograd" / "graph.py")
    assert lines.in_backward(frames + [FrameSummary(engine, 800, "_engine_run_backward")])


def test_the_start_up_lines():
    stopped = {"pid": 7, "host": "n1", "state": "T", "stop_signal": "SIGSTOP", "local": True}
    line = lines.init_unanswered(6, "localhost:29500", stopped)
    assert line == ("diagnose: init_process_group has waited 6s: nothing answers at localhost:29500, where rank 0 "
                    "opens the group's store: rank 0 has not called init_process_group: it is stopped by SIGSTOP "
                    "(pid 7, on n1): it runs nothing until it gets SIGCONT"), line
    assert "start rank 0 (or the first node) there" in lines.init_unanswered(6, "localhost:29500")
    line = lines.init_incomplete(6, "localhost:29500", 3, {1: stopped, 2: None})
    assert line == ("diagnose: init_process_group has waited 6s: the store at localhost:29500 answers, but the group "
                    "of 3 ranks is not complete: rank 1 has not called init_process_group: it is stopped by SIGSTOP "
                    "(pid 7, on n1): it runs nothing until it gets SIGCONT; rank 2 has not called init_process_group, "
                    "and no process of this host was started as it (another node's? check world_size and each rank's "
                    "rank)"), line
    assert lines.startup_cause("bind: EADDRINUSE port: 29500").startswith("diagnose: port 29500 is already in use")
    assert "GLOO_SOCKET_IFNAME" in lines.startup_cause("connectFullMesh failed remote=[127.0.1.1]:5000")
    assert lines.startup_cause("NCCL error: no GPUs found").startswith("diagnose: NCCL needs CUDA GPUs")
    assert lines.startup_cause("something else") is None


def test_a_port_in_use_is_traced_to_where_the_port_was_set(tmp_path):
    script = tmp_path / "train.py"
    script.write_text('import os\nos.environ["MASTER_PORT"] = "29500"  # the tutorial\'s line\n')
    assert lines.setting_line(str(script), "MASTER_PORT").endswith("train.py:2")
    assert lines.setting_line(str(tmp_path / "none.py"), "MASTER_PORT") is None
    assert lines.port_advice(29500, "tcp://h:1", {}) == "the script's init_method names it: change the port there"
    assert "--master_port" in lines.port_advice(29500, None, {"TORCHELASTIC_RUN_ID": "x"})
    own = lines.port_advice(29500, None, {names.LAUNCH_MASTER_PORT: "", "MASTER_PORT": "29500"}, str(script))
    assert own.startswith("the script sets MASTER_PORT=29500 itself at ") and "train.py:2" in own, own
    assert lines.port_advice(29500, None, {}) == "run with another MASTER_PORT (the environment's)"


def test_store_lost_and_missing_api():
    me = {"running": [{"seq": 5, "kind": "all_reduce", "shapes": "[3]"}], "where": "train.py:9"}
    assert lines.store_lost(me, "failed").startswith("diagnose: collective #5 (all_reduce of [3] at train.py:9) failed "
                                                     "and the group's store does not answer either")
    line = lines.missing_api("torch.x._y", "2.99.0", ("2.13.0",))
    assert line.startswith("diagnose: torch 2.99.0 has no torch.x._y, a private API this tool reads (tested with torch "
                           "2.13.0)"), line


def test_the_jobs_line_is_said_once_a_node_even_where_the_store_does_not_answer(tmp_path, monkeypatch):
    """ask.finish, as each rank of a node runs it: the store's claim, or the node folder's where the store's calls
    fail (a loaded host: a client's timeout), lets one rank say the line; a restart of torchrun says it again."""
    from torchdiagnose import ask

    class Store:
        def __init__(self, answers):
            self.answers = answers

        def compare_set(self, key, expected, value):
            if self.answers is None:
                raise TimeoutError("the store did not answer in time")
            return self.answers.setdefault(key, value).encode()

    said = []
    monkeypatch.setenv(names.FOLDER, str(tmp_path))
    monkeypatch.setenv(names.KEEP_WAITING, "1")  # finish() then returns instead of ending the process
    monkeypatch.setattr(ask, "declare", said.append)
    monkeypatch.setattr(lines, "write_dump", lambda rank, folder: False)
    monkeypatch.setattr(ask, "this_rank", lambda: 0)
    for restart in ("0", "1"):
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", restart)
        for answers in (None, {}, None):  # a rank whose store call fails, one whose works, one that fails
            monkeypatch.setattr(ask.STATE, "store", Store(answers))
            ask.finish({"line": f"diagnose: the line of round {restart}", "folder": str(tmp_path)})
    assert said == [f"diagnose: the line of round {n} (--keep-waiting: the job goes on waiting)" for n in "01"], said


def test_the_flight_recorder_hint_gives_the_command_that_reads_an_incomplete_set():
    answered = {0: {"recorder": True}, 1: {"recorder": True}}
    assert lines._flight_recorder(answered, [], 2, "fr_traces/x") == "flight recorder: `torchfrtrace fr_traces/x`"
    hint = lines._flight_recorder({0: {"recorder": True}}, [1], 2, "fr_traces/x")
    assert hint == ("no torchfrtrace: rank 1 did not answer, so wrote no flight recorder dump, and torchfrtrace "
                    "compares every rank's; rank 0 wrote its to fr_traces/x: `torchfrtrace --allow-incomplete-ranks "
                    "fr_traces/x` reads it"), hint
    assert lines._flight_recorder({0: {}}, [1], 2, "x").startswith("no flight recorder dumps: the recorder is off")


def test_shown_names_a_librarys_file_from_its_package_and_the_users_from_here():
    assert lines.shown(str(Path(torch.__file__).parent / "nn" / "functional.py")) == "torch/nn/functional.py"
    assert lines.shown(str(Path.cwd() / "train.py")) == "train.py"
    assert lines.shown("/elsewhere/far/model.py") == "model.py"  # outside the folder the rank runs in: its name
