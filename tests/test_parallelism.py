"""tensor_parallel.py, pipeline_parallel.py and nd_parallel.py training the decoder under torchrun on gloo, at 1, 2,
4 and 8 processes: what each rank holds and which collectives the layers run; the same numbers as one process in
every layout and pipeline schedule; each script resuming each one's checkpoints; a checkpoint killed mid-save never
loaded; Hugging Face out (transformers loads an export, logits equal) and in (a checkpoint transformers wrote trains
on in a split layout); bad input in one line, and checkpoints these scripts cannot go on from (another model, sizes
or optimizer layout, bytes flipped, fsdp.py's and theirs the other way round), each one line from rank 0.

The one-process reference is computed here, in this process, with plain torch (no torch.distributed): the Decoder,
AdamW, the mean cross-entropy of each step's tokens, in float64, over the same global batches (the epoch's order is
torch.randperm seeded with seed + epoch, as fsdp_checkpoint.GlobalOrderSampler cuts it). Checkpoints are read back
with DCP's own converter, not with the scripts.

Tolerance: the parallel runs add the same numbers in another order: TP sums o_proj's and down_proj's partial
products rank by rank, and the norms' weight gradients slice by slice of the sequence; FSDP sums the data-parallel
ranks' gradients and divides by dp; a pipeline adds the micro-batches' gradients one by one. Each step's rounding
differs in the last bits of float64 (about 1e-16 relative), and AdamW divides by the root of the squared
gradients' average, which keeps the difference relative. Over these runs (2 steps an epoch) the weights and
AdamW's first moment stay within WEIGHT_TOL = 1e-10 of one process's (measured: at most about 1e-16 to 1e-15),
while a wrong batch, a lost shard or a gradient scaled by dp is off by more than 1e-4. The printed epoch losses
have 6 decimals: LOSS_TOL = 1e-6.
"""
import functools
import json
import re
import shutil
import subprocess

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.checkpoint import FileSystemReader, save
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from conftest import (BIN, REPO, assert_one_line_error, assert_said_by_rank_0, checkpoint_sums, clean_env,
                      epoch_lines, finish, flip, forked, free_port, python_cmd, run, start, summary, torchrun_cmd)
import fsdp_checkpoint as checkpoint_dir
from language_model import Decoder, DecoderConfig, hf_name, read_text, text_splits

CONFIG = DecoderConfig(dim=32, n_layers=4, n_heads=8, n_kv_heads=4, hidden=64, max_seq_len=16)  # tp 4 splits it
TEXT_CHARS = 600  # 33 windows of 16 bytes to train on: 2 steps of 16 sequences an epoch, a second step a process
GLOBAL_BATCH = 16
SIZES = ("--dim", "32", "--n_layers", "4", "--n_heads", "8", "--n_kv_heads", "4", "--hidden", "64", "--seq_len", "16")
F64 = ("--dtype", "float64", "--global_batch_size", str(GLOBAL_BATCH), "--save_every", "1", "--log_every", "0",
       "--sample", "0", "--snapshot_path", "checkpoints", "--data", "text.txt", *SIZES)
WEIGHT_TOL = 1e-10
LOSS_TOL = 1e-6
ENV = {"OMP_NUM_THREADS": "1"}


def the_text():
    return read_text()[0][:TEXT_CHARS]


def reference_run(epochs, initial=None, seed=0, config=CONFIG, lrs=None):
    """One process, no torch.distributed: [(epoch loss a token, weights, AdamW's exp_avg) after each epoch]. With
    experts, each MoE layer adds its balance loss's gradient itself (its mean over the batch's sequences). lrs:
    {epoch: AdamW's lr in that epoch}, 3e-3 in the others."""
    dataset, _ = text_splits(the_text(), config.max_seq_len)
    size = len(dataset) // GLOBAL_BATCH * GLOBAL_BATCH  # whole steps, as the scripts train
    model = Decoder(config).init_weights(seed).double()
    if initial is not None:
        model.load_state_dict(initial)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    names = {p: name for name, p in model.named_parameters()}
    after = []
    for epoch in range(epochs):
        for group in optimizer.param_groups:
            group["lr"] = (lrs or {}).get(epoch, 3e-3)
        order = torch.randperm(size, generator=torch.Generator().manual_seed(seed + epoch))
        total = 0.0
        for start_ in range(0, size, GLOBAL_BATCH):
            source, targets = dataset[order[start_:start_ + GLOBAL_BATCH].tolist()]
            optimizer.zero_grad()
            loss = F.cross_entropy(model(source).flatten(0, 1), targets.flatten(), reduction="sum") / targets.numel()
            loss.backward()
            optimizer.step()
            total += loss.item() * GLOBAL_BATCH
        moment = {names[p]: state["exp_avg"].clone() for p, state in optimizer.state.items()}
        after.append((total / size, {k: v.clone() for k, v in model.state_dict().items()}, moment))
    return after


def single_threaded(work):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the launches run (OMP_NUM_THREADS=1); OpenMP's spinning threads cost more here
    try:
        return work()
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def from_hf(tmp_path_factory):
    """The matrix's folder, with the Llama its first launch starts from: LlamaForCausalLM.save_pretrained's folder
    llama/ (seeded weights, float64); (the folder, those weights under the Decoder's names)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    directory = tmp_path_factory.mktemp("matrix")
    hf_config = {k: v for k, v in CONFIG.hf_config().items() if k not in ("model_type", "architectures")}
    torch.manual_seed(1)
    hf = LlamaForCausalLM(LlamaConfig(**hf_config)).double()
    hf.save_pretrained(directory / "llama")
    return directory, {name: hf.state_dict()[hf_name(name)] for name in Decoder(CONFIG).state_dict()}


@pytest.fixture(scope="module")
def reference(from_hf):
    """One process's epochs from the Llama's weights, as many as the matrix's launches train, at each launch's
    --lr."""
    lrs = {epoch: float(flags[flags.index("--lr") + 1]) for epoch, (_, _, flags, _) in enumerate(MATRIX)
           if "--lr" in flags}
    return single_threaded(lambda: reference_run(len(MATRIX) + 1, initial=from_hf[1], lrs=lrs))


def newest(checkpoints):
    """The newest complete checkpoint (with fsdp_checkpoint's marker) in a directory."""
    return max(p for p in checkpoints.iterdir() if (p / checkpoint_dir.MARKER).exists())


def full_state(checkpoint, tmp_path):
    out = tmp_path / f"{checkpoint.name}-{len(list(tmp_path.iterdir()))}.pt"
    dcp_to_torch_save(checkpoint, out)
    return torch.load(out, weights_only=True)


def assert_matches_reference(state, reference, epochs, what, config=CONFIG, initial=None):
    """A checkpoint's weights and AdamW's first moment against one process's after `epochs` epochs (which started
    from `initial`, by default the Decoder's seed-0 weights)."""
    _, weights, moment = reference[epochs - 1]
    assert state["model"].keys() == weights.keys(), (what, sorted(state["model"]))
    for name, weight in weights.items():
        assert state["model"][name].dtype == torch.float64, (what, name)
        difference = (state["model"][name] - weight).abs().max().item()
        assert difference <= WEIGHT_TOL, f"{what}: {name} differs from one process's by {difference}"
        difference = (state["optimizer"][f"state.{name}.exp_avg"] - moment[name]).abs().max().item()
        assert difference <= WEIGHT_TOL, f"{what}: {name}'s exp_avg differs from one process's by {difference}"
    initial = Decoder(config).init_weights(0).state_dict() if initial is None else initial
    assert any((initial[n].double() - w).abs().max() > 1e-3 for n, w in weights.items()), "it must have trained"


def assert_losses_match(out, reference, epochs, what):
    lines = epoch_lines(out)
    assert [line.epoch for line in lines] == list(epochs), (what, out[-3000:])
    for line in lines:
        assert abs(line.loss - reference[line.epoch][0]) <= LOSS_TOL, (what, line, reference[line.epoch][0])


def launch(script, *args, nproc, cwd, check=True):
    result = run(torchrun_cmd(script, *args, nproc=nproc), cwd=cwd, env=clean_env(**ENV), timeout=300, check=check)
    return result.stdout + result.stderr if check else result


# ---- the resume matrix: each script resumes each one's checkpoints, an epoch a launch, a new layout each ----

T, P, N = "tensor_parallel.py", "pipeline_parallel.py", "nd_parallel.py"
# (script, processes, flags, the layout it prints): FSDP x CP x TP (the ring) from a checkpoint transformers wrote,
# then N->T, T->T, T->P, P->P, P->T (pp 4 into one process), T->N, N->N, N->P, P->N, each resume once; every pipeline
# schedule torch ships; HSDP, FSDP x TP x PP on 8 processes. The one-process tensor_parallel.py launch trains with
# --lr 1e-3, the others with the scripts' 3e-3: a checkpoint keeps AdamW's moments, not its settings.
MATRIX = [
    (N, 8, ("--dp", "2", "--cp", "2", "--tp", "2", "--init_from_hf", "llama"),
     "pp 1 x dp_replicate 1 x dp_shard 2 x cp 2 x tp 2"),
    (T, 2, (), "tp 2"),
    (T, 4, (), "tp 4"),
    (P, 4, ("--tp", "2", "--schedule", "interleaved_1f1b"), "pp 2 x tp 2"),
    (P, 4, ("--schedule", "gpipe"), "pp 4 x tp 1"),
    (T, 1, ("--lr", "1e-3"), "tp 1"),
    (N, 1, (), "pp 1 x dp_replicate 1 x dp_shard 1 x cp 1 x tp 1"),
    (N, 4, ("--dp", "4", "--dp_replicate", "2"), "pp 1 x dp_replicate 2 x dp_shard 2 x cp 1 x tp 1"),
    (P, 2, ("--schedule", "zbv"), "pp 2 x tp 1"),
    (N, 8, ("--pp", "2", "--dp", "2", "--tp", "2", "--schedule", "interleaved_zb"),
     "pp 2 x dp_replicate 1 x dp_shard 2 x cp 1 x tp 2"),
]


@pytest.fixture(scope="module")
def matrix(tmp_path_factory, from_hf):
    """MATRIX, an epoch a launch, all in float64 on one --snapshot_path, the first from_hf's Llama (each rank reads
    its pieces from the safetensors file); between the second and the third launch,
    pipeline_parallel.py with DualPipeV trains epoch 2 and is SIGKILLed while saving it, so that the third launch
    resumes from epoch 2's checkpoint. [(output, the directory's listing, the newest checkpoint's full state, its
    path, which file holds each tensor of its model)]."""
    directory = from_hf[0]
    states = tmp_path_factory.mktemp("states")
    (directory / "text.txt").write_text(the_text())
    checkpoints = directory / "checkpoints"
    found = []

    def after(out):
        path = newest(checkpoints)  # removed two launches later (the newest two are kept): read now
        files = {}
        for index, info in FileSystemReader(path).read_metadata().storage_data.items():
            if index.fqn.startswith("model."):
                files.setdefault(info.relative_path, set()).add(".".join(index.fqn.split(".")[1:3]))
        found.append((out, sorted(p.name for p in checkpoints.iterdir()), full_state(path, states), path, files))

    for epoch, (script, nproc, flags, _) in enumerate(MATRIX):
        if epoch == 2:
            # Rank 1, while it writes its part of the epoch-3 checkpoint: half a file, then a real SIGKILL (the probe).
            job = start(torchrun_cmd(P, "--total_epochs", "3", "--schedule", "dualpipev", *F64), cwd=directory,
                        env=clean_env(**ENV, DDP_EXAMPLES_PROBE_KILL_IN_SAVE="1:epoch_000003.tmp"))
            out = finish(job, 300)
            assert job.returncode != 0 and "SIGKILL" in out, out[-3000:]
            after(out)
        after(launch(script, "--total_epochs", epoch + 1, *flags, *F64, nproc=nproc, cwd=directory))
    return found


def matrix_run(matrix, epoch):
    """(output, listing, state, path, files) of the launch that trained `epoch` (the killed run sits before epoch
    2's)."""
    return matrix[epoch + (epoch >= 2)]


def test_tensor_parallel_prints_each_ranks_pieces_and_the_collectives_it_counted(matrix):
    out = matrix_run(matrix, 1)[0]
    assert "Mesh tp 2 | global batch 16, all of it on every rank" in out, out[-3000:]
    total = sum(p.numel() for p in Decoder(CONFIG).parameters())
    for rank in (0, 1):  # every part on every rank, a half of each: q_proj split by its output rows
        assert (f"Rank {rank} | embed_tokens, layers.0, layers.1, layers.2, layers.3, norm, lm_head | "
                f"{(total - 9 * 32) // 2 + 9 * 32:,} of {total:,} parameters | layers.0.self_attn.q_proj.weight "
                "[16, 32] of [32, 32]") in out, out[-3000:]
    # Counted by CommDebugMode in the first step: sequence parallelism all-gathers the sequence before attention
    # and the MLP and reduce-scatters their outputs, forward; the reverse backward.
    layers = re.findall(r"^Layer (\d) \| forward (.*) \| backward (.*)$", out, re.M)
    both = "all_gather_into_tensor x2, reduce_scatter_tensor x2"
    assert layers == [(str(i), both, both) for i in range(4)], out[-3000:]
    assert (summary(out).world_size, summary(out).backend) == (2, "gloo")


def test_pipeline_stages_keep_the_full_names_and_report_their_idle_time(matrix):
    out = matrix_run(matrix, 4)[0]
    assert "Mesh pp 4 x tp 1 | 16 sequences in 4 micro-batches | global batch 16 | schedule gpipe" in out, out[-3000:]
    parts = ["embed_tokens, layers.0", "layers.1", "layers.2", "layers.3, norm, lm_head"]
    for stage, names in enumerate(parts):
        assert re.search(rf"^Rank {stage} \| pp {stage} tp 0 \| stage {stage}: {names} \| [\d,]+ of [\d,]+ "
                         "parameters$", out, re.M), out
    idle = re.findall(r"^Rank (\d) \| stage (\d) \| idle ([\d.]+)% of a step, measured \| bubble \(p-1\)/\(m\+p-1\) = "
                      r"([\d.]+)%, textbook$", out, re.M)
    assert [rank for rank, _, _, _ in idle] == ["0", "1", "2", "3"], out[-3000:]
    for _, _, measured, textbook in idle:
        assert textbook == "42.9" and 0 <= float(measured) < 100  # (4-1)/(4+4-1)
    # V-shaped: rank 0 runs stages 0 and 3, rank 1 stages 1 and 2; each stage wrote its own parameters, under the
    # full model's names, into its rank's file.
    out = matrix_run(matrix, 8)[0]
    assert re.search(r"^Rank 0 \| pp 0 tp 0 \| stage 0: embed_tokens, layers.0 \| .* \| stage 3: layers.3, norm, "
                     r"lm_head \|", out, re.M), out[-3000:]
    assert re.search(r"^Rank 1 \| stages 1, 2 \| idle [\d.]+% of a step, measured \| bubble near 0", out, re.M), out
    files = matrix_run(matrix, 8)[4]
    assert files == {"__0_0.distcp": {"embed_tokens.weight", "layers.0", "layers.3", "norm.weight", "lm_head.weight"},
                     "__1_0.distcp": {"layers.1", "layers.2"}}, files


def test_each_script_resumes_each_ones_checkpoints_as_one_uninterrupted_process(matrix, reference, from_hf):
    for epoch, (script, _, _, layout) in enumerate(MATRIX):
        out, _, state, _, _ = matrix_run(matrix, epoch)
        what = f"{script} {layout} (epoch {epoch})"
        assert f"Mesh {layout} |" in out, (what, out[-3000:])
        if epoch:
            _, processes, _, saved = MATRIX[epoch - 1]
            assert (f"Resuming from checkpoints/epoch_{epoch:06d} at epoch {epoch}, saved as {saved} on {processes} "
                    "process") in out, (what, out[-3000:])
        assert_losses_match(out, reference, [epoch], what)
        assert_matches_reference(state, reference, epoch + 1, what, initial=from_hf[1])


def test_a_checkpoint_killed_mid_save_is_never_loaded(matrix, reference):
    """pipeline_parallel.py (DualPipeV, 2 processes) SIGKILLed on rank 1 while it wrote epoch 3's checkpoint: the
    next launch resumes from epoch 2's, and removes the half-written one."""
    killed_out, listing, _, _, _ = matrix[2]
    assert listing == ["epoch_000001", "epoch_000002", "epoch_000003.tmp"], listing  # the killed save's .tmp
    assert_losses_match(killed_out, reference, [2], "pp 2, DualPipeV, killed while saving")
    out, listing, _, _, _ = matrix_run(matrix, 2)
    assert "Resuming from checkpoints/epoch_000002 at epoch 2, saved as tp 2 on 2 processes" in out, out[-3000:]
    assert listing == ["epoch_000002", "epoch_000003"], "the .tmp removed, the two newest kept"


def test_the_optimizers_settings_are_the_scripts_own_not_the_checkpoints(matrix, from_hf):
    """A run resumed with another --lr trains on with it, and the run resumed from it without --lr with the script's
    3e-3 again (the checkpoint keeps AdamW's moments, not its settings): the matrix's tensor_parallel.py on one
    process, --lr 1e-3, between launches of 3e-3. Each checkpoint holds the lr its run took; the weights are one
    process's that changed its lr there and back (test_each_script_resumes_each_ones_checkpoints_as_one_...), and
    far from one process's that kept 3e-3."""
    epoch = next(e for e, (_, _, flags, _) in enumerate(MATRIX) if "--lr" in flags)
    states = [matrix_run(matrix, e)[2] for e in (epoch - 1, epoch, epoch + 1)]
    for name in states[0]["model"]:
        assert [state["optimizer"][f"param_groups.{name}.lr"] for state in states] == [3e-3, 1e-3, 3e-3], name
    kept = single_threaded(lambda: reference_run(epoch + 1, initial=from_hf[1]))[epoch][1]
    assert max((states[1]["model"][n] - w).abs().max().item() for n, w in kept.items()) > 1e-4, "--lr changed nothing"


def test_3d_parallel_on_8_processes_places_every_rank_on_the_mesh(matrix):
    """The matrix's FSDP x TP x PP launch: tp innermost, then dp_shard, then pp; each rank two looped stages of one
    layer each (stage s and s + 2), a quarter of each layer's q_proj (tp splits its rows, FSDP shards them)."""
    out = matrix_run(matrix, 9)[0]
    assert ("Mesh pp 2 x dp_replicate 1 x dp_shard 2 x cp 1 x tp 2 | 8 sequences a data-parallel rank in 4 "
            "micro-batches | global batch 16 | schedule interleaved_zb") in out, out[-3000:]
    total = sum(p.numel() for p in Decoder(CONFIG).parameters())
    stage = (rf"stage (\d): ([^|]+) \| ([\d,]+) of {total:,} parameters \| "
             r"layers\.(\d)\.self_attn\.q_proj\.weight \[8, 32\] of \[32, 32\]")
    ranks = re.findall(rf"^Rank (\d) \| pp (\d) dp_replicate 0 dp_shard (\d) cp 0 tp (\d) \| {stage} \| {stage}$", out,
                       re.M)
    assert len(ranks) == 8, out[-3000:]
    stage_parts = ["embed_tokens, layers.0", "layers.1", "layers.2", "layers.3, norm, lm_head"]
    for rank, pp, dp, tp, *stages in ranks:
        assert int(rank) == (int(pp) * 2 + int(dp)) * 2 + int(tp), ranks
        held = 0
        for index, (number, parts, count, layer) in enumerate(zip(*[iter(stages)] * 4)):
            assert int(number) == int(pp) + 2 * index and layer == number, ranks
            assert parts.strip() == stage_parts[int(number)], ranks
            held += int(count.replace(",", ""))
        assert total / 8 * 0.8 < held < total / 8 * 1.2, "an eighth of the model each"
    assert (summary(out).world_size, summary(out).backend) == (8, "gloo")


# ---- context and expert parallelism: each sequence split over cp ranks, the experts over ep ranks ----

# The layers' outputs and gradients (of order 1) against one process's, float64: measured <= 5e-15 (attention),
# 0 (the experts' outputs and gradients, the same additions), 3e-14 (the router's gradient, summed over ranks).
LAYER_TOL = 1e-12


@pytest.fixture(scope="module")
def parallel_layers(ep_chain):
    """tests/support/parallel_layers_check.py on 4 processes (the MoE chain's last launch, before nd_parallel.py):
    context_parallel.py's attention at cp 2 and 4 and expert_parallel.py's dispatch at ep 2 and 4, each rank against
    one process's, computed on every rank from the same seeded tensors."""
    return ep_chain[0][LAYERS_CHECKED][0]


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("form", ["ring", "allgather"])
def test_context_parallel_attention_is_one_process_sdpa_forward_and_backward(parallel_layers, cp, form):
    found = re.search(rf"^cp {cp} {form} \| forward (\S+) \| dq (\S+) \| dk (\S+) \| dv (\S+)$", parallel_layers,
                      re.M)
    assert found, parallel_layers[-3000:]
    errors = [float(error) for error in found.groups()]
    assert all(error <= LAYER_TOL for error in errors), (cp, form, errors)


@pytest.mark.parametrize("ep", [2, 4])
def test_expert_parallel_dispatch_is_one_process_moe_forward_and_backward(parallel_layers, ep):
    found = re.search(rf"^ep {ep} \| forward (\S+) \| dx (\S+) \| drouter (\S+) \| dexperts (\S+) \| tokens per "
                      r"expert ([\d ]+)$", parallel_layers, re.M)
    assert found, parallel_layers[-3000:]
    errors = [float(error) for error in found.groups()[:4]]
    assert all(error <= LAYER_TOL for error in errors), (ep, errors)
    routed = [int(count) for count in found.group(5).split()]
    assert len(routed) == 8 and sum(routed) == 2 * ep * 16 * 2, routed  # every token to 2 of 8 experts: dropless


CHECKER = REPO / "tests" / "support" / "contiguous_collectives.py"
LAYERS = REPO / "tests" / "support" / "parallel_layers_check.py"


def launch_checked(*args, nproc, cwd, layers=False):
    """A launch of nd_parallel.py whose collectives stop it on a tensor that is not contiguous (CHECKER); with
    `layers`, LAYERS' checks first, in the same processes."""
    return launch(CHECKER, *([LAYERS] if layers else []), REPO / N, *args, nproc=nproc, cwd=cwd)


def test_context_parallel_places_cp_inside_tp_and_gives_each_rank_an_early_and_a_late_chunk(matrix):
    """The matrix's FSDP 2 x CP 2 x TP 2 launch (the ring; its numbers are one process's in
    test_each_script_resumes_each_ones_checkpoints_as_one_uninterrupted_process)."""
    out = matrix_run(matrix, 0)[0]
    ranks = re.findall(r"^Rank (\d) \| pp 0 dp_replicate 0 dp_shard (\d) cp (\d) tp (\d) \| tokens (\d+)-(\d+) and "
                       r"(\d+)-(\d+) of 16 \| stage 0:", out, re.M)
    assert len(ranks) == 8, out[-3000:]
    for rank, dp, cp, tp, *tokens in ranks:
        assert int(rank) == (int(dp) * 2 + int(cp)) * 2 + int(tp), ranks  # tp innermost, then cp, then dp_shard
        chunks = [(0, 3, 12, 15), (4, 7, 8, 11)][int(cp)]  # 4 chunks of 4 tokens: cp rank i holds i and 3 - i
        assert tuple(map(int, tokens)) == chunks, ranks


# nd_parallel.py with --n_experts 4 (top 2), an epoch a launch, each resumed from the one before, cp and ep changing
# each time: FSDP x CP x EP (the ring), then a pipeline of them on 8 processes (all-gathered keys and values), HSDP x
# EP, and CP 4 alone (all-gathered) with every expert on every rank, FSDP2 sharding over its 4 cp ranks.
MOE_CONFIG = DecoderConfig(dim=32, n_layers=4, n_heads=8, n_kv_heads=4, hidden=64, max_seq_len=16, n_experts=4)
EP_CHAIN = [(4, ("--dp", "2", "--cp", "2", "--ep", "2"), "pp 1 x dp_replicate 1 x dp_shard 2 x cp 2 x tp 1 | ep 2"),
            (8, ("--pp", "2", "--dp", "2", "--cp", "2", "--ep", "4", "--cp_attention", "allgather"),
             "pp 2 x dp_replicate 1 x dp_shard 2 x cp 2 x tp 1 | ep 4"),
            (4, ("--dp", "4", "--dp_replicate", "2", "--ep", "2"),
             "pp 1 x dp_replicate 2 x dp_shard 2 x cp 1 x tp 1 | ep 2"),
            (4, ("--cp", "4", "--cp_attention", "allgather"), "pp 1 x dp_replicate 1 x dp_shard 1 x cp 4 x tp 1")]
CHECKED = (0, 3)  # the launches of EP_CHAIN under CHECKER
LAYERS_CHECKED = 3  # the launch of EP_CHAIN that runs LAYERS' checks first (4 processes)


@pytest.fixture(scope="module")
def ep_chain(tmp_path_factory):
    """EP_CHAIN, each launch resumed from the one before; the first (the ring, the all-to-all) and the last (the
    all-gather at cp 4) check their collectives' tensors; the last runs LAYERS' checks before nd_parallel.py."""
    directory, states = tmp_path_factory.mktemp("ep-chain"), tmp_path_factory.mktemp("ep-chain-states")
    (directory / "text.txt").write_text(the_text())
    found = []
    for epoch, (nproc, flags, _) in enumerate(EP_CHAIN):
        start_ = (functools.partial(launch_checked, layers=epoch == LAYERS_CHECKED) if epoch in CHECKED
                  else functools.partial(launch, N))
        out = start_("--total_epochs", epoch + 1, "--n_experts", "4", *flags, *F64, nproc=nproc, cwd=directory)
        found.append((out, full_state(newest(directory / "checkpoints"), states)))
    return found, newest(directory / "checkpoints")


def test_a_mixture_of_experts_resumed_across_ep_and_cp_layouts_trains_as_one_uninterrupted_process(ep_chain):
    """The four launches of EP_CHAIN, an epoch each: every epoch's loss and every checkpoint's weights (the experts
    at their full shapes, [4, 64, 32]) and first moment are one process's, within the tolerance; each epoch prints
    the tokens each expert of each layer got, every token to 2 of the 4."""
    reference = single_threaded(lambda: reference_run(len(EP_CHAIN), config=MOE_CONFIG))
    for epoch, (out, state) in enumerate(ep_chain[0]):
        nproc, _, mesh = EP_CHAIN[epoch]
        assert f"Mesh {mesh} |" in out, (mesh, out[-3000:])
        if epoch:
            before, processes = EP_CHAIN[epoch - 1][2], EP_CHAIN[epoch - 1][0]
            assert (f"Resuming from checkpoints/epoch_{epoch:06d} at epoch {epoch}, saved as {before} on {processes} "
                    "process") in out, (mesh, out[-3000:])
        assert_losses_match(out, reference, [epoch], mesh)
        assert_matches_reference(state, reference, epoch + 1, mesh, config=MOE_CONFIG)
        assert list(state["model"]["layers.0.mlp.experts.gate_proj"].shape) == [4, 64, 32]
        routing = re.search(r"^Tokens per expert \| (.*)$", out, re.M)
        assert routing, out[-3000:]
        layers = [part.split() for part in routing.group(1).split(" | ")]
        assert [layer[0] for layer in layers] == [f"layers.{i}" for i in range(4)], routing.group(0)
        for layer in layers:  # 2 steps of 16 sequences of 16 tokens, each token to 2 experts
            assert len(layer) == 5 and sum(map(int, layer[1:])) == 2 * 16 * 16 * 2, routing.group(0)


def test_hf_checkpoint_refuses_a_mixture_of_experts(ep_chain, tmp_path):
    """A Llama's MLPs are dense: the MoE chain's last checkpoint is no Llama, one line, nothing written."""
    checkpoint = ep_chain[1]
    result = run([BIN / "python", REPO / "hf_checkpoint.py", checkpoint, tmp_path / "llama"], cwd=tmp_path, check=False)
    assert_one_line_error(result, f"error: {checkpoint} holds a mixture of 4 experts a layer", code=1)
    assert not (tmp_path / "llama").exists()


def test_no_tensor_reaches_a_collective_non_contiguous(ep_chain):
    """gloo sends a view's storage, not its elements, in scatter and in torch.distributed.nn's all_gather backward
    (pytorch#192920): wrong values, no error. Two launches of the MoE chain ran under CHECKER: the ring with the
    experts' all-to-all at dp 2 x cp 2 x ep 2, and the all-gathered attention at cp 4, forward, backward, FSDP2 and
    DCP; every call of every rank took contiguous tensors (else it stopped), and the checker did check (the
    counts)."""
    for epoch in CHECKED:
        out, nproc = ep_chain[0][epoch][0], EP_CHAIN[epoch][0]
        # Not anchored to a line: the ranks share torchrun's stdout, and two lines can meet ("... 246 callscontig...").
        counts = dict(re.findall(r"contiguity checked: rank (\d), (\d+) calls", out))
        assert sorted(counts) == [str(rank) for rank in range(nproc)], out[-3000:]
        # At least the attention's own: a gather or ring forward and its backward, each layer (4), each step (2).
        assert all(int(count) >= 2 * 4 * 2 for count in counts.values()), counts
    from support.contiguous_collectives import checking
    calls = []
    check = checking("all_reduce", lambda *tensors: calls.append(tensors))
    check(torch.ones(4, 2))
    with pytest.raises(AssertionError, match=r"non-contiguous tensor to torch.distributed.all_reduce: shape \[2, 4\]"):
        check(torch.ones(4, 2).t())
    assert len(calls) == 1, "the view never reached the collective"


# ---- Hugging Face in and out ----

def test_an_export_loads_in_transformers_with_our_logits(matrix, tmp_path):
    """The last launch's checkpoint (saved by nd_parallel.py as FSDP x TP x PP on 8 processes; the matrix's runs
    wrote its history in 10 layouts) exported, loaded by LlamaForCausalLM.from_pretrained: its logits are the
    decoder's, in float64, up to Hugging Face's float32 RMSNorm and rotary angles (measured: about 1e-7)."""
    from transformers import LlamaForCausalLM
    checkpoint = matrix_run(matrix, len(MATRIX) - 1)[3]
    result = run([BIN / "python", REPO / "hf_checkpoint.py", checkpoint, tmp_path / "llama"], cwd=tmp_path)
    _, processes, _, layout = MATRIX[-1]
    assert re.match(rf"Exported {re.escape(str(checkpoint))} \([\d,]+ parameters, float64, saved as {layout} on "
                    rf"{processes} processes\)\nto {re.escape(str(tmp_path / 'llama'))}: "
                    "LlamaForCausalLM.from_pretrained", result.stdout), result.stdout
    hf = LlamaForCausalLM.from_pretrained(tmp_path / "llama")
    ours = checkpoint_dir.load_whole_model(Decoder(CONFIG).double(), checkpoint)
    tokens = torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(0))
    assert hf.dtype == torch.float64
    with torch.no_grad():
        difference = (hf(tokens).logits - ours(tokens)).abs().max().item()
    assert difference < 1e-5, difference
    assert {hf_name(n) for n in ours.state_dict()} == set(hf.state_dict()), "the same names, less model."


def test_a_checkpoint_transformers_wrote_trains_on_in_a_split_layout(matrix, reference, from_hf):
    """LlamaForCausalLM.save_pretrained's folder, loaded by nd_parallel.py as FSDP 2 x CP 2 x TP 2 (the matrix's
    first launch: each rank reads its pieces from the safetensors file), trains the epoch one process trains from
    the same weights."""
    out, _, state, _, _ = matrix_run(matrix, 0)
    assert "Mesh pp 1 x dp_replicate 1 x dp_shard 2 x cp 2 x tp 2 |" in out, out[-3000:]
    assert "Starting from llama (Hugging Face's format)" in out, out[-3000:]
    assert_losses_match(out, reference, [0], "from Hugging Face, 2 x 2 x 2")
    assert_matches_reference(state, reference, 1, "from HF", initial=from_hf[1])


# ---- bad input: one line, before any work ----

def test_bad_sizes_are_one_line_before_any_work(tmp_path):
    cases = [  # script, arguments, processes, what the line says
        (N, ("--dp", "2", "--tp", "2"), 2, "--dp 2 x --cp 1 x --tp 2 x --pp 1 must be the 2 processes"),
        (N, ("--tp", "2", "--n_kv_heads", "1"), 2, "tp 2 does not divide --n_kv_heads (1)"),
        (T, ("--n_heads", "3", "--n_kv_heads", "3", "--dim", "96"), 2, "tp 2 does not divide --n_heads (3)"),
        (T, ("--seq_len", "127",), 2, "tp 2 does not divide --seq_len (127)"),
        (P, ("--n_layers", "1"), 2, "2 stages (--pp 2, schedule 1f1b) are more than the 1 layers"),
        (P, ("--n_layers", "3", "--schedule", "zbv"), 2, "4 stages (--pp 2, schedule zbv) are more than the 3"),
        (P, ("--tp", "3"), 2, "--tp 3 x --pp ? must be the 2 processes torchrun started"),
        (N, ("--microbatches", "3"), 1, "--dp 1 x --microbatches 3 must divide --global_batch_size 16"),
        (T, ("--data", "nowhere.txt"), 1, "--data nowhere.txt: not a UTF-8 text file this can read ([Errno 2]"),
        (P, ("--data", "short.txt"), 1, "short.txt, 10 characters makes 0 sequences of 64 bytes to train on, "
                                        "fewer than --global_batch_size 16"),
        (N, ("--cp", "3"), 2, "--dp ? x --cp 3 x --tp 1 x --pp 1 must be the 2 processes torchrun started"),
        (N, ("--cp", "2", "--seq_len", "18"), 2, "--seq_len 18 must cut into 2 x --cp 2 equal chunks, two a cp rank"),
        (N, ("--ep", "2"), 2, "--ep 2 splits the experts, and there are none: give --n_experts"),
        (N, ("--ep", "2", "--n_experts", "3"), 2, "--ep 2 must divide --n_experts 3"),
        (N, ("--ep", "2", "--n_experts", "4", "--pp", "2"), 2, "--ep 2 must divide the 1 ranks of dp_shard x cp"),
        (N, ("--n_experts", "4", "--tp", "2"), 2, "--n_experts with --tp: this step splits the experts over ep"),
        (N, ("--n_experts", "4", "--top_k", "5"), 1, "--top_k 5 of --n_experts 4"),
        (N, ("--n_experts", "-2"), 1, "--n_experts -2: 0 (the dense MLP) or more experts"),
        (N, ("--n_experts", "4", "--init_from_hf", "llama"), 1, "--init_from_hf starts from a Llama, whose MLPs are"),
    ]
    (tmp_path / "short.txt").write_text("tiny text\n")
    # The first case under torchrun, whose report of the failed ranks follows the line; the others as rank 0 of
    # the launch, alone (the checks come before the process group, and every rank makes them alike), each its
    # script's command line in a process forked from one that imported torch once (tests/support/forked_runs.py).
    script, args, nproc, _ = cases[0]
    job = start(torchrun_cmd(script, *args, nproc=nproc), cwd=tmp_path, env=clean_env(**ENV), merge_output=False)
    ranks_0 = run(python_cmd(REPO / "tests" / "support" / "forked_runs.py", json.dumps(
        [[script, args, nproc] for script, args, nproc, _ in cases[1:]])), cwd=tmp_path, env=clean_env(**ENV),
        timeout=300)
    out, err = finish(job, 180)
    results = [subprocess.CompletedProcess(job.args, job.returncode, out, err)]
    results += [subprocess.CompletedProcess(case[:2], *said) for case, said in zip(cases[1:],
                                                                                   json.loads(ranks_0.stdout))]
    assert len(results) == len(cases), ranks_0.stdout[-3000:]
    for i, (result, (script, args, _, fragment)) in enumerate(zip(results, cases)):
        assert_one_line_error(result, f"{script}: error: {fragment}", code=1 if i == 0 else 2)  # torchrun exits 1
        assert not epoch_lines(result.stdout), (script, args)
    assert [p.name for p in tmp_path.iterdir()] == ["short.txt"], "stopped before making the checkpoints' directory"


def write_checkpoint(model, optimizer, flatten, checkpoint):
    """A checkpoint as the scripts write it (the full model's names), after one step, its optimizer's state flattened
    or not; its marker lists every file's sum."""
    model(torch.randint(0, 256, (2, 16))).sum().backward()
    optimizer.step()
    model_state, optimizer_state = get_state_dict(model, optimizer,
                                                  options=StateDictOptions(flatten_optimizer_state_dict=flatten))
    save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=checkpoint, no_dist=True)
    (checkpoint / checkpoint_dir.MARKER).write_text(json.dumps({"epochs_run": 1, "position": 0, "steps": 4,
                                                                  "files": checkpoint_sums(checkpoint)}))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # no_dist=True: this process saves alone
def test_checkpoints_these_scripts_cannot_go_on_from_are_one_line_from_rank_0(matrix, tmp_path):
    """Side by side, each in a folder of its own: the decoder narrower; the same decoder with its optimizer's state
    nested (as fsdp.py saves its own), which DCP would call a missing key; the matrix's last checkpoint with 400 bytes
    flipped in its shard; fsdp.py on that checkpoint, named by its marker, and again with the marker as an older
    fsdp_checkpoint.py wrote it (no architecture, dataset or batch: the tensors tell); a --snapshot_path that is a
    file. Each stops before any step with its line, said by rank 0 alone, and leaves the checkpoints as they
    were."""
    last = matrix_run(matrix, len(MATRIX) - 1)[3]  # nd_parallel.py's, at epoch 10

    def folder(case):
        (tmp_path / case).mkdir()
        (tmp_path / case / "text.txt").write_text(the_text())
        return tmp_path / case / "checkpoints"

    narrow = Decoder(DecoderConfig(dim=16, n_layers=4, n_heads=4, n_kv_heads=2, hidden=64, max_seq_len=16))
    write_checkpoint(narrow, torch.optim.AdamW(narrow.parameters()), True, folder("narrow") / "epoch_000001")
    nested = Decoder(CONFIG).init_weights(0).double()
    write_checkpoint(nested, torch.optim.AdamW(nested.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1),
                     False, folder("nested") / "epoch_000001")
    shutil.copytree(last, folder("flipped") / last.name)
    flip(tmp_path / "flipped" / "checkpoints" / last.name / "__0_0.distcp")
    shutil.copytree(last, folder("fsdp") / last.name)
    shutil.copytree(last, folder("fsdp_older") / last.name)
    marker = tmp_path / "fsdp_older" / "checkpoints" / last.name / checkpoint_dir.MARKER
    marker.write_text(json.dumps({key: value for key, value in json.loads(marker.read_text()).items()
                                  if key in ("epochs_run", "position", "steps", "world_size")}))
    folder("file")
    (tmp_path / "file" / "checkpoints").write_text("a file")
    newest = f"checkpoints/{last.name}"
    cases = [  # folder, script, processes, flags, what the line says
        ("narrow", N, 1, F64, ["checkpoint checkpoints/epoch_000001 does not fit this model",
                               "model.embed_tokens.weight is [256, 16], here [256, 32]"]),
        ("nested", T, 2, F64, ["checkpoint checkpoints/epoch_000001 keeps its optimizer state nested (optimizer."
                               "param_groups.0.lr", "and this script keeps it flattened (optimizer.param_groups."
                               "<parameter>.lr", "another layout; pass another --snapshot_path"]),
        ("flipped", P, 2, F64, [f"checkpoint {newest} is damaged: __0_0.distcp does not match its sum (CRC-32 ",
                                "pass --skip_damaged to set it aside"]),
        ("fsdp", "fsdp.py", 2, ("--snapshot_path", "checkpoints", "--batch_size", "256"),
         [f"checkpoint {newest} holds another model (Decoder, saved by nd_parallel.py); this script trains a "
          "BlockMLP: pass another --snapshot_path"]),
        ("fsdp_older", "fsdp.py", 1, ("--snapshot_path", "checkpoints"),
         [f"checkpoint {newest} holds another model (model.embed_tokens.weight, model.layers.0.",
          "not this script's (model.blocks.0.fc1.bias, model.blocks.0.fc1.weight, ... 30 tensors): pass another"]),
        ("file", N, 2, F64, ["--snapshot_path checkpoints is a file, not a folder: each checkpoint is a folder"]),
    ]
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    # Under torchrun, the cases of 2 processes whose line comes after the process group: rank 0 says it, the other
    # rank nothing. The others (one process, or the folder check rank 0 makes before its process group) as rank 0 of
    # the launch, each its script's command line in a child forked from one process that imported torch once: a
    # process group of one on a free port of its own.
    launched = [case for case in cases if case[2] > 1 and case[0] != "file"]
    jobs = [start(torchrun_cmd(script, "--total_epochs", "12", *flags, nproc=nproc), cwd=tmp_path / case,
                  env=clean_env(**ENV), merge_output=False) for case, script, nproc, flags, _ in launched]
    alone = [case for case in cases if case not in launched]
    results = forked([[script, ["--total_epochs", "12", *flags], nproc,
                       {"cwd": tmp_path / case, "env": {**ENV, "MASTER_PORT": free_port()}}]
                      for case, script, nproc, flags, _ in alone], cwd=tmp_path, env=clean_env(**ENV))
    for job in jobs:
        out, err = finish(job, 300)
        results.append(subprocess.CompletedProcess(job.args, job.returncode, out, err))
    assert len(results) == len(cases)
    for result, (*_, fragments) in zip(results, alone + launched):
        assert_said_by_rank_0(result, *fragments)
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
