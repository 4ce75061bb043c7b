"""Train, export and check callguard's fraud model.

    python notebooks/model.py train FEATURES.parquet MODEL.onnx --inputs a,b,c
        trains a LightGBM classifier on the labelled attempts of a `callguard
        features` table and exports it to ONNX (a classifier without ZipMap:
        callguard scores with its `probabilities[:, 1]`).
    python notebooks/model.py check FEATURES.parquet MODEL.onnx --inputs a,b,c
        scores every attempt of a `callguard features` table (made with the
        model in the rule set) with onnxruntime, and compares each score with
        the table's `score` column; exits 1 if one differs by more than 1e-5.

The inputs go to the model as float32, nulls as NaN, as a pandas frame
gives them: what callguard feeds it.
"""

import argparse
import sys

import numpy as np
import pyarrow.parquet as pq

TOLERANCE = 1e-5


def matrix(table, inputs):
    """The model's input matrix: the columns in order, float32, nulls NaN."""
    cols = []
    for name in inputs:
        if name not in table.column_names:
            sys.exit(f"no column {name!r} in the features table")
        cols.append(table.column(name).to_numpy(zero_copy_only=False).astype("float64"))
    return np.column_stack(cols).astype(np.float32)


def train(args):
    import lightgbm as lgb
    from onnxmltools import convert_lightgbm
    from onnxmltools.convert.common.data_types import FloatTensorType

    t = pq.read_table(args.features)
    label = t.column("label").to_numpy(zero_copy_only=False)
    known = np.array([v is not None for v in label])
    x = matrix(t, args.inputs)[known]
    y = label[known].astype(int)
    model = lgb.LGBMClassifier(
        n_estimators=args.trees,
        max_depth=args.depth,
        num_leaves=min(2**args.depth, 31),
        learning_rate=0.1,
        random_state=1,
        deterministic=True,
        n_jobs=1,
        verbose=-1,
    ).fit(x, y)
    onx = convert_lightgbm(
        model,
        initial_types=[("features", FloatTensorType([None, len(args.inputs)]))],
        zipmap=False,
        target_opset=15,
    )
    with open(args.model, "wb") as f:
        f.write(onx.SerializeToString())
    print(f"trained on {len(y)} attempts ({int(y.sum())} fraud): {args.model}")


def check(args):
    import onnxruntime as ort

    t = pq.read_table(args.features)
    if "score" not in t.column_names:
        sys.exit("no score column: make the table with the model in the rule set")
    x = matrix(t, args.inputs)
    got = t.column("score").to_numpy(zero_copy_only=False).astype("float64")
    session = ort.InferenceSession(args.model, providers=["CPUExecutionProvider"])
    outputs = [o.name for o in session.get_outputs()]
    want = session.run(["probabilities"], {session.get_inputs()[0].name: x})[0][:, 1]
    if np.isnan(got).any():
        sys.exit(f"{int(np.isnan(got).sum())} attempts have no score")
    diff = np.abs(got - want.astype("float64"))
    worst = float(diff.max()) if len(diff) else 0.0
    bad = int((diff > TOLERANCE).sum())
    print(f"rows {len(got)} max_diff {worst:.3g} over_{TOLERANCE} {bad} outputs {outputs}")
    sys.exit(1 if bad else 0)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=["train", "check"])
    p.add_argument("features")
    p.add_argument("model")
    p.add_argument("--inputs", required=True, type=lambda s: s.split(","))
    p.add_argument("--trees", type=int, default=50)
    p.add_argument("--depth", type=int, default=4)
    args = p.parse_args()
    {"train": train, "check": check}[args.command](args)


if __name__ == "__main__":
    main()
