//! The tree-ensemble operator's compiled walk (`Walk`, in the patched
//! `vendor/tract-onnx-opl`) against the operator's own node-by-node walk:
//! random ensembles with every comparison the walk takes, NaN sent either
//! way, thresholds at zero, the extremes and the infinities, and rows that
//! hit them exactly. The sums must be equal to the bit.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tract_onnx_opl::ml::tree::{Aggregate, Cmp, TreeEnsemble, TreeEnsembleData};

use tract_onnx::prelude::tract_ndarray::{Array2, Axis};
use tract_onnx::prelude::*;

const FEATURES: usize = 3;
const CLASSES: usize = 2;

/// Values where a comparison's edge lies: both zeros, the smallest and
/// greatest magnitudes, and the infinities (thresholds and inputs alike).
const EDGES: [f32; 9] = [
    0.0,
    -0.0,
    1.5,
    -2.25,
    f32::MIN_POSITIVE,
    f32::MAX,
    f32::MIN,
    f32::INFINITY,
    f32::NEG_INFINITY,
];

struct Builder {
    nodes: Vec<[u32; 5]>,
    leaves: Vec<[u32; 2]>,
    infinite: bool,
}

impl Builder {
    fn value(rng: &mut StdRng) -> f32 {
        if rng.random_bool(0.5) {
            EDGES[rng.random_range(0..EDGES.len())]
        } else {
            rng.random_range(-4.0f32..4.0)
        }
    }

    /// A tree's node at `depth` and, under a branch, its subtrees; returns
    /// the node's index. `modes` are the comparisons drawn from.
    fn node(&mut self, rng: &mut StdRng, depth: u32, modes: &[Cmp]) -> u32 {
        let at = self.nodes.len() as u32;
        if depth == 0 || rng.random_bool(0.25) {
            let start = self.leaves.len() as u32;
            let class = rng.random_range(0..CLASSES as u32);
            self.leaves
                .push([class, rng.random_range(-1.0f32..1.0).to_bits()]);
            self.nodes.push([start, start + 1, 0, 0, 0]);
            return at;
        }
        self.nodes.push([0; 5]);
        let cmp = modes[rng.random_range(0..modes.len())];
        let t = Self::value(rng);
        self.infinite |= t.is_infinite();
        let if_true = self.node(rng, depth - 1, modes);
        let if_false = self.node(rng, depth - 1, modes);
        let nan = if rng.random_bool(0.5) { 0x100 } else { 0 };
        self.nodes[at as usize] = [
            rng.random_range(0..FEATURES as u32),
            if_true,
            if_false,
            t.to_bits(),
            cmp.to_u8() as u32 | nan,
        ];
        at
    }
}

/// A random ensemble of up to 8 trees of depth up to 6, and whether one of
/// its thresholds is infinite.
fn ensemble(rng: &mut StdRng, modes: &[Cmp]) -> (TreeEnsembleData, bool) {
    let mut b = Builder {
        nodes: vec![],
        leaves: vec![],
        infinite: false,
    };
    let roots: Vec<u32> = (0..rng.random_range(1..=8))
        .map(|_| {
            let depth = rng.random_range(0..=6);
            b.node(rng, depth, modes)
        })
        .collect();
    let nodes: Vec<u32> = b.nodes.iter().flatten().copied().collect();
    let leaves: Vec<u32> = b.leaves.iter().flatten().copied().collect();
    let data = TreeEnsembleData {
        trees: rctensor1(&roots),
        nodes: tensor1(&nodes)
            .into_shape(&[b.nodes.len(), 5])
            .unwrap()
            .into_arc_tensor(),
        leaves: tensor1(&leaves)
            .into_shape(&[b.leaves.len(), 2])
            .unwrap()
            .into_arc_tensor(),
    };
    (data, b.infinite)
}

fn rows(rng: &mut StdRng) -> Array2<f32> {
    let n = rng.random_range(1..=40);
    Array2::from_shape_fn((n, FEATURES), |_| {
        if rng.random_bool(0.15) {
            f32::NAN
        } else {
            Builder::value(rng)
        }
    })
}

fn bits(a: &tract_onnx::prelude::tract_ndarray::ArrayD<f32>) -> Vec<u32> {
    a.iter().map(|x| x.to_bits()).collect()
}

/// The compiled walk and the node-by-node walk give the same sums, to the
/// bit, over 3,000 random ensembles; the walk is taken for every ensemble
/// without `==` or `!=` (so the test checks it, not
/// the fallback); an infinite threshold is among them.
#[test]
fn the_compiled_walk_sums_as_the_operators_own_walk() {
    let mut rng = StdRng::seed_from_u64(53);
    let ordered = [Cmp::LessEqual, Cmp::Less, Cmp::Greater, Cmp::GreaterEqual];
    let all = [
        Cmp::LessEqual,
        Cmp::Less,
        Cmp::Greater,
        Cmp::GreaterEqual,
        Cmp::Equal,
        Cmp::NotEqual,
    ];
    let mut compiled = 0;
    let mut infinite_seen = 0;
    for case in 0..3000 {
        let modes: &[Cmp] = if case % 10 == 9 { &all } else { &ordered };
        let (data, infinite) = ensemble(&mut rng, modes);
        let fast =
            TreeEnsemble::build(data.clone(), FEATURES - 1, CLASSES, Aggregate::Sum).unwrap();
        let reference = TreeEnsemble {
            walk: None,
            ..fast.clone()
        };
        if std::ptr::eq(modes, &ordered[..]) {
            assert!(
                fast.walk.is_some(),
                "case {case}: an ensemble the walk takes was not compiled"
            );
        }
        compiled += fast.walk.is_some() as usize;
        infinite_seen += infinite as usize;
        let input = rows(&mut rng);
        let got = fast.eval(input.view().into_dyn()).unwrap();
        let want = reference.eval(input.view().into_dyn()).unwrap();
        assert_eq!(got.shape(), want.shape());
        for (row, (g, w)) in got
            .axis_iter(Axis(0))
            .zip(want.axis_iter(Axis(0)))
            .enumerate()
        {
            assert_eq!(
                bits(&g.to_owned().into_dyn()),
                bits(&w.to_owned().into_dyn()),
                "case {case}, row {row} ({:?}): walk {g} against the operator's {w}\n{data}",
                input.row(row)
            );
        }
    }
    assert!(
        compiled >= 2700,
        "only {compiled} of 3000 ensembles compiled"
    );
    assert!(
        infinite_seen > 500,
        "only {infinite_seen} ensembles with an infinite threshold"
    );
}

/// An ensemble with `==` is left to the operator's own walk.
#[test]
fn an_ensemble_with_equality_is_not_compiled() {
    let nodes = [
        [0u32, 1, 2, 1.0f32.to_bits(), Cmp::Equal.to_u8() as u32],
        [0, 1, 0, 0, 0],
        [1, 2, 0, 0, 0],
    ];
    let leaves = [[0u32, 0.5f32.to_bits()], [0, (-0.5f32).to_bits()]];
    let data = TreeEnsembleData {
        trees: rctensor1(&[0u32]),
        nodes: tensor1(&nodes.iter().flatten().copied().collect::<Vec<u32>>())
            .into_shape(&[3, 5])
            .unwrap()
            .into_arc_tensor(),
        leaves: tensor1(&leaves.iter().flatten().copied().collect::<Vec<u32>>())
            .into_shape(&[2, 2])
            .unwrap()
            .into_arc_tensor(),
    };
    let e = TreeEnsemble::build(data, 0, 1, Aggregate::Sum).unwrap();
    assert!(e.walk.is_none());
    let out = e
        .eval(
            Array2::from_shape_vec((2, 1), vec![1.0f32, 2.0])
                .unwrap()
                .view()
                .into_dyn(),
        )
        .unwrap();
    assert_eq!(out.iter().copied().collect::<Vec<f32>>(), vec![0.5, -0.5]);
}
