//! Running an ONNX model with tract: loaded once per rule set, run once per
//! batch of calls on a `[calls, inputs]` matrix of `f32`.

use std::sync::Arc;

use tract_onnx::prelude::*;
use tract_onnx::tract_hir::infer::Factoid;

/// Which output holds the score, and where in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pick {
    /// `[calls, 2]` class probabilities (`probabilities` of a classifier
    /// exported without ZipMap): the positive class's, column 1.
    Positive,
    /// `[calls]` or `[calls, 1]`: the one value.
    Only,
}

/// A loaded, optimised model that scores rows of `width` features.
pub struct Scorer {
    plan: Arc<TypedSimplePlan>,
    width: usize,
    pick: Pick,
}

impl std::fmt::Debug for Scorer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scorer")
            .field("width", &self.width)
            .field("pick", &self.pick)
            .finish_non_exhaustive()
    }
}

/// The name ONNX classifiers give their class probabilities.
const PROBABILITIES: &str = "probabilities";

impl Scorer {
    /// Loads the ONNX model in `bytes`, which must take one float input of
    /// `[batch, width]` and give a score: one output, or an output named
    /// `probabilities` of two classes. Every error says what was expected.
    pub fn load(bytes: &[u8], width: usize) -> Result<Self, String> {
        let mut model = tract_onnx::onnx()
            .model_for_read(&mut &bytes[..])
            .map_err(|e| format!("not an ONNX model tract can read: {}", root_cause(&e)))?;
        let inputs = model.input_outlets().map_err(|e| e.to_string())?.len();
        if inputs != 1 {
            return Err(format!(
                "the model takes {inputs} inputs; callguard gives it one, a [calls, {width}] float matrix"
            ));
        }
        if let Some(declared) = declared_width(&model) {
            if declared != width {
                return Err(format!(
                    "the model takes {declared} features a call, and `inputs` names {width}"
                ));
            }
        }
        let pick = pick_output(&mut model)?;
        let batch = model.symbols.sym("calls");
        model
            .set_input_fact(0, f32::fact([batch.to_dim(), width.to_dim()]).into())
            .map_err(|e| e.to_string())?;
        let plan = model
            .into_optimized()
            .and_then(|m| m.into_runnable())
            .map_err(|e| {
                format!(
                    "the model cannot run on [calls, {width}] floats: {}",
                    root_cause(&e)
                )
            })?;
        let scorer = Scorer { plan, width, pick };
        // A first run, on one row of missing values: a model that loads but
        // cannot score is an error now, not at the first call.
        scorer.score(&vec![f32::NAN; width])?;
        Ok(scorer)
    }

    /// The scores of `rows` (row after row, `width` values each).
    pub fn score(&self, rows: &[f32]) -> Result<Vec<f32>, String> {
        let n = rows.len() / self.width.max(1);
        if n == 0 {
            return Ok(Vec::new());
        }
        let input = Tensor::from_shape(&[n, self.width], rows).map_err(|e| e.to_string())?;
        let out = self
            .plan
            .run(tvec!(input.into()))
            .map_err(|e| format!("scoring: {}", root_cause(&e)))?;
        let out = out.first().ok_or("the model gave no output")?;
        let values = out
            .to_plain_array_view::<f32>()
            .map_err(|e| format!("the model's score is not float: {e}"))?;
        let shape = values.shape().to_vec();
        let scores: Vec<f32> = match (self.pick, shape.as_slice()) {
            (Pick::Positive, [rows, 2]) if *rows == n => {
                values.iter().skip(1).step_by(2).copied().collect()
            }
            (Pick::Only, [rows]) | (Pick::Only, [rows, 1]) if *rows == n => {
                values.iter().copied().collect()
            }
            _ => {
                return Err(format!(
                    "the model's score has shape {shape:?} for {n} calls: expected [{n}, 2] class probabilities or [{n}] scores"
                ))
            }
        };
        Ok(scores)
    }
}

/// The declared number of features of the model's one input, if its
/// shape is `[batch, k]` with `k` known.
fn declared_width(model: &InferenceModel) -> Option<usize> {
    let fact = model.input_fact(0).ok()?;
    let dims: Vec<_> = fact.shape.dims().collect();
    let k = dims.get(1)?.concretize()?;
    k.to_i64().ok().and_then(|k| usize::try_from(k).ok())
}

/// Keeps only the output holding the score: `probabilities` (class 1 of
/// two) if there is one, or the model's only output.
fn pick_output(model: &mut InferenceModel) -> Result<Pick, String> {
    let outputs = model.output_outlets().map_err(|e| e.to_string())?.to_vec();
    let named = outputs
        .iter()
        .find(|&&o| model.outlet_label(o) == Some(PROBABILITIES))
        .copied();
    let (outlet, pick) = match (named, outputs.as_slice()) {
        (Some(o), _) => (o, Pick::Positive),
        (None, [only]) => (*only, Pick::Only),
        (None, _) => {
            let names: Vec<&str> = outputs
                .iter()
                .map(|&o| model.outlet_label(o).unwrap_or("?"))
                .collect();
            return Err(format!(
                "the model has {} outputs ({}) and none named `{PROBABILITIES}`: export a classifier without ZipMap, or a model with one score output",
                outputs.len(),
                names.join(", ")
            ));
        }
    };
    model
        .select_output_outlets(&[outlet])
        .map_err(|e| e.to_string())?;
    Ok(pick)
}

/// The innermost message of a tract error (its chain says where tract was,
/// the root what went wrong).
fn root_cause(e: &TractError) -> String {
    e.root_cause().to_string()
}
