"""Hugging Face out: a checkpoint of steps 6 to 8, saved in any layout, as a folder that transformers loads.

    python hf_checkpoint.py nd_parallel_checkpoints/epoch_000001 my_llama
    python -c "from transformers import LlamaForCausalLM as L; print(L.from_pretrained('my_llama'))"

It reads the model's tensors from the checkpoint's shards in this one process (no process group), renames them
as LlamaForCausalLM names its own ("model." in front, lm_head as it is), and writes them with DCP's Hugging Face
storage writer (model-00001-of-00001.safetensors and its index), beside a config.json made from the sizes the
checkpoint's complete marker records. It prints:

    Exported nd_parallel_checkpoints/epoch_000001 (853,120 parameters, float32, saved as pp 2 x ... on 8 processes)
    to my_llama: LlamaForCausalLM.from_pretrained("my_llama") loads it

Hugging Face in is a flag of the training scripts: --init_from_hf DIR starts tensor_parallel.py,
pipeline_parallel.py or nd_parallel.py from such a folder (one this script wrote, or one transformers wrote with
save_pretrained), in any layout: DCP's HuggingFaceStorageReader reads each rank's pieces from the safetensors files.
"""
import argparse
import json
import os
import sys
import warnings

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageWriter

from fsdp_checkpoint import MARKER, load_whole_model
from language_model import Decoder, DecoderConfig, hf_name


def export(checkpoint, out):
    """Write the checkpoint's model into `out` in Hugging Face's format; returns (parameters, dtype, marker)."""
    with open(os.path.join(checkpoint, MARKER)) as f:
        where = json.load(f)
    config = DecoderConfig(**where["model"])
    if config.n_experts:
        sys.exit(f"error: {checkpoint} holds a mixture of {config.n_experts} experts a layer: a Llama's MLPs are "
                 "dense, and this script writes a Llama")
    model = Decoder(config)
    dtype = dcp_dtype(checkpoint)
    load_whole_model(model.to(dtype), checkpoint)
    weights = {hf_name(name): tensor.contiguous() for name, tensor in model.state_dict().items()}
    os.makedirs(out, exist_ok=True)
    with warnings.catch_warnings():  # DCP's note that it saves in one process: what this script does
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(weights, storage_writer=HuggingFaceStorageWriter(path=out), no_dist=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump({**config.hf_config(), "dtype": str(dtype).removeprefix("torch.")}, f, indent=2)
    return sum(t.numel() for t in weights.values()), dtype, where


def dcp_dtype(checkpoint):
    """The dtype the checkpoint's weights were saved in (--dtype of the run)."""
    metadata = dcp.FileSystemReader(checkpoint).read_metadata()
    return metadata.state_dict_metadata["model.lm_head.weight"].properties.dtype


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a complete checkpoint of tensor_parallel.py, pipeline_parallel.py or "
                        "nd_parallel.py (a folder epoch_... with complete.json)")
    parser.add_argument("out", help="the folder to write (made if missing)")
    args = parser.parse_args(argv)
    if not os.path.isfile(os.path.join(args.checkpoint, MARKER)):
        parser.error(f"{args.checkpoint} is not a complete checkpoint of steps 6 to 8 (no {MARKER} in it)")
    if os.path.isfile(args.out):
        parser.error(f"{args.out} is a file: give a folder to write the model into")
    try:
        parameters, dtype, where = export(args.checkpoint, args.out)
    except (KeyError, TypeError) as error:  # a marker without the model's sizes: another script's checkpoint
        sys.exit(f"error: {args.checkpoint} holds no decoder of steps 6 to 8 ({type(error).__name__}: {error})")
    print(f"Exported {args.checkpoint} ({parameters:,} parameters, {str(dtype).removeprefix('torch.')}, saved as "
          f"{where.get('layout', '?')} on {where['world_size']} process{'es' * (where['world_size'] > 1)})\n"
          f"to {args.out}: LlamaForCausalLM.from_pretrained({json.dumps(args.out)}) loads it")


if __name__ == "__main__":
    main()
