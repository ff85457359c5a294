"""MNIST for the Hugging Face Trainer: a datasets.DatasetDict with "train" and "test" splits and
"image"/"label" columns, from the Hub, from the four IDX files or from save_to_disk, and the collate
function that turns its rows into the model's inputs."""
import os

import numpy as np
import pyarrow as pa
import torch
from datasets import Dataset, DatasetDict, load_dataset, load_from_disk
from huggingface_hub import constants, get_session

from ddp_common.errors import UsageError, one_line
from ddp_common.data import MEAN, STD, load_mnist, mnist_pixels  # noqa: F401 (MEAN, STD: for the tests)

HUB_DATASET = "ylecun/mnist"
GET_THE_DATA = ("give --data_dir DIR with the four MNIST IDX files (train-images-idx3-ubyte[.gz], "
                "train-labels-idx1-ubyte[.gz], t10k-images-idx3-ubyte[.gz], t10k-labels-idx1-ubyte[.gz]) "
                "or a DatasetDict written by save_to_disk")


def load_mnist_splits(data_dir=None, cache_dir=None):
    """The DatasetDict from --data_dir, or from the Hub (cached in cache_dir or datasets' own cache)."""
    if data_dir is None:
        splits = _from_hub(cache_dir)
    elif not os.path.isdir(data_dir):
        raise UsageError(f"--data_dir {data_dir} is not a directory; {GET_THE_DATA}")
    elif os.path.isfile(os.path.join(data_dir, "dataset_dict.json")):
        splits = _from_disk(data_dir)
    else:
        splits = DatasetDict({split: _from_idx(data_dir, split) for split in ("train", "test")})
    # Rows come out as numpy arrays whatever the source stores (PIL images from the Hub, flat pixels here).
    return splits.with_format("numpy")


def _from_hub(cache_dir):
    if not constants.HF_HUB_OFFLINE:
        # Without a network the Hub client retries for half a minute before giving up: ask once instead.
        try:
            get_session().head(constants.ENDPOINT, timeout=10)
        except Exception as error:  # whatever the HTTP client raises: no DNS, refused, timeout, proxy
            raise UsageError(f"cannot reach {constants.ENDPOINT} to download {HUB_DATASET} ({one_line(error)}); "
                             f"{GET_THE_DATA}, or set HF_HUB_OFFLINE=1 to use a copy downloaded earlier") from None
    try:
        splits = load_dataset(HUB_DATASET, cache_dir=cache_dir)
    except ConnectionError as error:  # also what offline mode raises when nothing is cached
        raise UsageError(f"cannot load {HUB_DATASET} ({one_line(error)}); {GET_THE_DATA}") from None
    return _checked(splits, HUB_DATASET)


def _from_disk(data_dir):
    try:
        splits = load_from_disk(data_dir)
    except (OSError, ValueError) as error:
        raise UsageError(f"cannot load the dataset saved in {data_dir} ({one_line(error)})") from None
    return _checked(splits, data_dir)


def _checked(splits, source):
    for split in ("train", "test"):
        if split not in splits:
            raise UsageError(f"{source} has no {split!r} split (it has {', '.join(splits) or 'none'}); "
                             "MNIST needs 'train' and 'test'")
        missing = {"image", "label"} - set(splits[split].column_names)
        if missing:
            raise UsageError(f"the {split!r} split of {source} lacks the column(s) {', '.join(sorted(missing))}")
    return splits


def _from_idx(data_dir, split):
    images, labels = load_mnist(data_dir, split)
    # Straight into Arrow without copying: Dataset.from_dict would take half a minute for 60,000 images.
    pixels = pa.FixedSizeListArray.from_arrays(pa.array(images.reshape(-1)), 28 * 28)
    return Dataset(pa.table({"image": pixels, "label": pa.array(labels)}))


def collate(rows):
    """Rows of the DatasetDict -> {"image": float (B, 1, 28, 28), normalised, "labels": int64 (B)}."""
    labels = torch.tensor(np.array([row["label"] for row in rows]), dtype=torch.int64)
    return {"image": mnist_pixels(np.stack([row["image"] for row in rows])), "labels": labels}
