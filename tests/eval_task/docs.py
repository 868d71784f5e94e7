"""The documents of the test tasks: one JSONL file each, found next to this file from any working directory."""
import json
import os

import datasets


def load(file, **kwargs):
    """lm-eval's custom_dataset: {"test": the documents of `file`}; kwargs are the task's metadata."""
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), file)) as f:
        return datasets.DatasetDict({"test": datasets.Dataset.from_list([json.loads(line) for line in f])})
