//! The tuning plot: against N, the rejected share and recall (top panel,
//! 0-100%) and, with labels, the legit false-reject rate on a panel of its
//! own with a log scale (it spans orders of magnitude, from tens of percent
//! at small N to hundredths near the recommendation), never clipped. The
//! recommended N is marked on both panels, the `--max-false-reject` line on
//! the lower one.

use std::ops::Range;
use std::path::Path;

use plotters::coord::{CoordTranslate, Shift};
use plotters::prelude::*;

use crate::error::IoError;
use crate::offline::tune::{ModelSweep, Sweep, SweepRow, Target, ThresholdRow};

/// Fonts tried for the plot's text.
const FONT_PATHS: [&str; 4] = [
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
];

/// Picture size; the lower panel (when drawn) takes this share of the height.
const SIZE: (u32, u32) = (1000, 800);
const LOWER_SHARE: f64 = 0.45;

/// The false-reject rate's colour; the `--max-false-reject` line's.
const FALSE_REJECT: RGBColor = RED;
const MAX_LINE: RGBColor = RGBColor(230, 140, 0);

fn plot_err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

/// Checks that `path` names a format a plot is drawn in: `.svg` or `.png`
/// (either case); its answer is whether it is SVG.
pub fn check_path(path: &Path) -> Result<bool, IoError> {
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
    if ext.eq_ignore_ascii_case("svg") {
        Ok(true)
    } else if ext.eq_ignore_ascii_case("png") {
        Ok(false)
    } else {
        Err(IoError::UnknownExtension {
            path: path.to_path_buf(),
            expected: ".png or .svg",
        })
    }
}

/// Draws the sweep to `path` (`.svg` or `.png`).
pub fn draw(sweep: &Sweep, path: &Path) -> Result<(), IoError> {
    let svg = check_path(path)?;
    draw_to(sweep, path, svg).map_err(|problem| IoError::Plot {
        path: path.to_path_buf(),
        problem,
    })
}

fn draw_to(sweep: &Sweep, path: &Path, svg: bool) -> Result<(), String> {
    register_font()?;
    if svg {
        let root = SVGBackend::new(path, SIZE).into_drawing_area();
        panels(sweep, &root)?;
        root.present().map_err(plot_err)
    } else {
        let root = BitMapBackend::new(path, SIZE).into_drawing_area();
        panels(sweep, &root)?;
        root.present().map_err(plot_err)
    }
}

/// Draws a model's threshold sweep (`tune --model`) to `path` (`.svg` or
/// `.png`): recall, precision and the legit false-reject rate against the
/// threshold, the rules alone as dashed levels, the recommendation marked.
pub fn draw_model(sweep: &ModelSweep, path: &Path) -> Result<(), IoError> {
    let svg = check_path(path)?;
    let drawn = register_font().and_then(|()| {
        if svg {
            let root = SVGBackend::new(path, SIZE).into_drawing_area();
            model_panel(sweep, &root)?;
            root.present().map_err(plot_err)
        } else {
            let root = BitMapBackend::new(path, SIZE).into_drawing_area();
            model_panel(sweep, &root)?;
            root.present().map_err(plot_err)
        }
    });
    drawn.map_err(|problem| IoError::Plot {
        path: path.to_path_buf(),
        problem,
    })
}

fn model_panel<DB: DrawingBackend>(
    s: &ModelSweep,
    root: &DrawingArea<DB, Shift>,
) -> Result<(), String>
where
    DB::ErrorType: 'static,
{
    root.fill(&WHITE).map_err(plot_err)?;
    let root = root
        .titled(
            "callguard tune --model: the model's threshold",
            ("sans-serif", 24),
        )
        .map_err(plot_err)?;
    let lo = s.rows.first().and_then(|r| r.threshold).unwrap_or(0.0) as f64;
    let hi = s.rows.last().and_then(|r| r.threshold).unwrap_or(1.0) as f64;
    let mut c = ChartBuilder::on(&root)
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(lo.min(hi - 0.01)..hi, 0f64..100f64)
        .map_err(plot_err)?;
    c.configure_mesh()
        .x_desc("threshold (reject at or above this score)")
        .y_desc("%")
        .y_label_formatter(&|v| format!("{v:.0}%"))
        .draw()
        .map_err(plot_err)?;
    let at = |f: &dyn Fn(&ThresholdRow) -> Option<f64>| -> Vec<(f64, f64)> {
        s.rows
            .iter()
            .filter_map(|r| Some((f64::from(r.threshold?), f(r)? * 100.0)))
            .collect()
    };
    let lines: [Curve<'_>; 4] = [
        (
            "recall (fraud calls caught)",
            GREEN,
            at(&|r| Some(r.recall)),
            s.rules_alone.recall,
        ),
        (
            "precision",
            BLUE,
            at(&|r| r.precision),
            s.rules_alone.precision.unwrap_or(0.0),
        ),
        (
            "legit false-reject rate",
            FALSE_REJECT,
            at(&|r| Some(r.false_reject_rate)),
            s.rules_alone.false_reject_rate,
        ),
        (
            "legit calls rejected by the model",
            MAX_LINE,
            at(&|r| Some(r.model_false_reject_rate)),
            0.0,
        ),
    ];
    for (name, color, pts, alone) in lines {
        c.draw_series(LineSeries::new(pts, color.stroke_width(2)))
            .map_err(plot_err)?
            .label(name)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
        // The rules alone: the level the model adds to.
        c.draw_series(DashedLineSeries::new(
            vec![(lo, alone * 100.0), (hi, alone * 100.0)],
            6,
            4,
            color.stroke_width(1),
        ))
        .map_err(plot_err)?;
    }
    if let Some(t) = s.recommended.and_then(|i| s.rows[i].threshold) {
        let t = f64::from(t);
        c.draw_series(std::iter::once(PathElement::new(
            vec![(t, 0.0), (t, 100.0)],
            BLACK.stroke_width(1),
        )))
        .map_err(plot_err)?
        .label(format!(
            "recommended threshold = {t:.3} (dashed: the rules alone)"
        ))
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLACK));
    }
    legend(&mut c)
}

/// A model sweep's curve: its name, colour, points, and the rules alone's level.
type Curve<'a> = (&'a str, RGBColor, Vec<(f64, f64)>, f64);

/// Registers the plots' TrueType font (for SVG as well as PNG).
fn register_font() -> Result<(), String> {
    // Text is laid out with a TrueType font, for SVG as well as PNG.
    let font = FONT_PATHS
        .iter()
        .find_map(|p| std::fs::read(p).ok())
        .ok_or_else(|| {
            "no TrueType font found to draw text (Debian: apt-get install fonts-dejavu-core)"
                .to_string()
        })?;
    // plotters keeps registered fonts for the whole program: leaked once per plot.
    let font: &'static [u8] = Box::leak(font.into_boxed_slice());
    plotters::style::register_font("sans-serif", FontStyle::Normal, font)
        .map_err(|_| plot_err("bad font file"))
}

/// The points of one curve: (N, value in percent), rows without a value left out.
fn series(sweep: &Sweep, f: impl Fn(&SweepRow) -> Option<f64>) -> Vec<(f64, f64)> {
    sweep
        .rows
        .iter()
        .filter_map(|r| f(r).map(|v| (r.limit as f64, v * 100.0)))
        .collect()
}

/// The N axis: the swept limits (at least one unit wide).
fn n_range(sweep: &Sweep) -> Range<f64> {
    let lo = sweep.rows.first().map_or(1, |r| r.limit);
    let hi = sweep.rows.last().map_or(lo, |r| r.limit).max(lo + 1);
    lo as f64..hi as f64
}

/// The `--max-false-reject` bound in percent, when it chose N.
fn max_false_reject_pct(sweep: &Sweep) -> Option<f64> {
    match sweep.target {
        Target::MaxFalseReject(max) if sweep.labelled => Some(max * 100.0),
        _ => None,
    }
}

/// The log-scale extent (percent) of the false-reject panel: every positive
/// rate and the bound drawn, with half a decade of room each side, so no
/// point is clipped. `None` when there is nothing positive to draw.
pub fn false_reject_extent(rates_pct: &[f64], bound_pct: Option<f64>) -> Option<Range<f64>> {
    let positive = rates_pct
        .iter()
        .copied()
        .chain(bound_pct)
        .filter(|v| v.is_finite() && *v > 0.0);
    let (lo, hi) = positive.fold(None, |acc: Option<(f64, f64)>, v| {
        Some(acc.map_or((v, v), |(lo, hi)| (lo.min(v), hi.max(v))))
    })?;
    let room = 10f64.sqrt();
    Some(lo / room..hi * room)
}

fn panels<DB: DrawingBackend>(sweep: &Sweep, root: &DrawingArea<DB, Shift>) -> Result<(), String>
where
    DB::ErrorType: 'static,
{
    root.fill(&WHITE).map_err(plot_err)?;
    let title = format!("callguard tune: limit N of rule `{}`", sweep.rule);
    let root = root.titled(&title, ("sans-serif", 24)).map_err(plot_err)?;
    // The swept rule's own false rejects: what its N costs (the other
    // rules' share is the same for every N), and what is recommended on.
    let rates = series(sweep, |r| r.rule_false_reject_rate);
    let bound = max_false_reject_pct(sweep);
    let extent = false_reject_extent(&rates.iter().map(|(_, v)| *v).collect::<Vec<_>>(), bound);
    match extent {
        Some(extent) if sweep.labelled => {
            let upper_px = (f64::from(root.dim_in_pixel().1) * (1.0 - LOWER_SHARE)) as u32;
            let (upper, lower) = root.split_vertically(upper_px);
            shares(sweep, &upper)?;
            false_rejects(sweep, &lower, &rates, bound, extent)
        }
        _ => shares(sweep, &root),
    }
}

/// The upper panel: calls rejected and recall, in percent (0 to 100).
fn shares<DB: DrawingBackend>(sweep: &Sweep, area: &DrawingArea<DB, Shift>) -> Result<(), String>
where
    DB::ErrorType: 'static,
{
    let mut c = ChartBuilder::on(area)
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(n_range(sweep), 0f64..100f64)
        .map_err(plot_err)?;
    c.configure_mesh()
        .x_desc("N (calls allowed in the window)")
        .y_desc("% of calls")
        .x_label_formatter(&|n| format!("{n:.0}"))
        .y_label_formatter(&|v| format!("{v:.0}%"))
        .draw()
        .map_err(plot_err)?;
    let lines = [
        (
            "calls rejected",
            BLUE,
            series(sweep, |r| Some(r.rejected_share)),
        ),
        (
            "recall (fraud calls caught)",
            GREEN,
            series(sweep, |r| r.recall),
        ),
    ];
    for (name, color, pts) in lines {
        if pts.is_empty() {
            continue;
        }
        c.draw_series(LineSeries::new(pts, color.stroke_width(2)))
            .map_err(plot_err)?
            .label(name)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
    }
    if let Some(n) = sweep.recommended {
        c.draw_series(std::iter::once(PathElement::new(
            vec![(n as f64, 0.0), (n as f64, 100.0)],
            BLACK.stroke_width(1),
        )))
        .map_err(plot_err)?
        .label(format!("recommended N = {n}"))
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLACK));
    }
    legend(&mut c)
}

/// The lower panel: the legit false-reject rate on a log scale; rates of
/// zero (no legit call rejected) as hollow marks on the bottom edge.
fn false_rejects<DB: DrawingBackend>(
    sweep: &Sweep,
    area: &DrawingArea<DB, Shift>,
    rates: &[(f64, f64)],
    bound: Option<f64>,
    extent: Range<f64>,
) -> Result<(), String>
where
    DB::ErrorType: 'static,
{
    let floor = extent.start;
    let top = extent.end;
    let mut c = ChartBuilder::on(area)
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(n_range(sweep), extent.log_scale())
        .map_err(plot_err)?;
    c.configure_mesh()
        .x_desc("N (calls allowed in the window)")
        .y_desc("% of legit calls (log)")
        .x_label_formatter(&|n| format!("{n:.0}"))
        .y_label_formatter(&|v| percent(*v))
        .draw()
        .map_err(plot_err)?;
    let positive: Vec<(f64, f64)> = rates.iter().copied().filter(|(_, v)| *v > 0.0).collect();
    c.draw_series(LineSeries::new(positive, FALSE_REJECT.stroke_width(2)))
        .map_err(plot_err)?
        .label("false-reject rate (legit calls the rule alone rejects)")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], FALSE_REJECT.stroke_width(2)));
    let zeros: Vec<(f64, f64)> = rates
        .iter()
        .filter(|(_, v)| *v <= 0.0)
        .map(|(n, _)| (*n, floor))
        .collect();
    if !zeros.is_empty() {
        c.draw_series(
            zeros
                .into_iter()
                .map(|p| Circle::new(p, 3, FALSE_REJECT.stroke_width(1))),
        )
        .map_err(plot_err)?
        .label("no legit call rejected (0%)")
        .legend(|(x, y)| Circle::new((x + 10, y), 3, FALSE_REJECT.stroke_width(1)));
    }
    if let Some(max) = bound {
        let (lo, hi) = (n_range(sweep).start, n_range(sweep).end);
        c.draw_series(std::iter::once(PathElement::new(
            vec![(lo, max), (hi, max)],
            MAX_LINE.stroke_width(2),
        )))
        .map_err(plot_err)?
        .label(format!("--max-false-reject {}", percent(max)))
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], MAX_LINE.stroke_width(2)));
    }
    if let Some(n) = sweep.recommended {
        c.draw_series(std::iter::once(PathElement::new(
            vec![(n as f64, floor), (n as f64, top)],
            BLACK.stroke_width(1),
        )))
        .map_err(plot_err)?;
    }
    legend(&mut c)
}

/// The legend box of a panel, upper right.
fn legend<'a, DB: DrawingBackend + 'a, CT: CoordTranslate>(
    c: &mut ChartContext<'a, DB, CT>,
) -> Result<(), String>
where
    DB::ErrorType: 'static,
{
    c.configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperRight)
        .draw()
        .map_err(plot_err)
}

/// A percentage with as many decimals as its size needs (`12%`, `0.2%`, `0.006%`).
fn percent(v: f64) -> String {
    let decimals = if v >= 10.0 || v <= 0.0 {
        0
    } else {
        // One significant digit past the first non-zero one.
        (1.0 - v.log10().floor()).clamp(0.0, 8.0) as usize
    };
    let text = format!("{v:.decimals$}");
    let text = if text.contains('.') {
        text.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        text
    };
    format!("{text}%")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_extent_holds_every_positive_rate_and_the_bound() {
        let rates = [47.27, 0.17, 0.006, 0.0, 0.0];
        let e = false_reject_extent(&rates, Some(0.2)).unwrap();
        assert!(e.start < 0.006 && e.end > 47.27, "{e:?}");
        let e = false_reject_extent(&[0.0, 0.0], Some(0.2)).unwrap();
        assert!(e.contains(&0.2), "{e:?}");
        let e = false_reject_extent(&[3.0], Some(50.0)).unwrap();
        assert!(e.end > 50.0 && e.start < 3.0, "{e:?}");
        assert_eq!(false_reject_extent(&[0.0], None), None);
    }

    #[test]
    fn percentages_keep_their_significant_digit() {
        assert_eq!(percent(47.27), "47%");
        assert_eq!(percent(0.2), "0.2%");
        assert_eq!(percent(0.17), "0.17%");
        assert_eq!(percent(0.006), "0.006%");
        assert_eq!(percent(1.0), "1%");
        assert_eq!(percent(0.0), "0%");
    }
}
