//! The tuning plot: rejected share, recall and false-reject rate against N.

use std::path::Path;

use plotters::coord::Shift;
use plotters::prelude::*;

use crate::error::IoError;
use crate::offline::tune::Sweep;

/// Fonts tried for the plot's text.
const FONT_PATHS: [&str; 4] = [
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
];

fn plot_err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

/// Draws the sweep to `path` (`.svg` or `.png`).
pub fn draw(sweep: &Sweep, path: &Path) -> Result<(), IoError> {
    draw_to(sweep, path).map_err(|problem| IoError::Plot {
        path: path.to_path_buf(),
        problem,
    })
}

fn draw_to(sweep: &Sweep, path: &Path) -> Result<(), String> {
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
        .map_err(|_| plot_err("bad font file"))?;
    if path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("svg"))
    {
        let root = SVGBackend::new(path, (1000, 600)).into_drawing_area();
        chart(sweep, &root)?;
        root.present().map_err(plot_err)
    } else {
        let root = BitMapBackend::new(path, (1000, 600)).into_drawing_area();
        chart(sweep, &root)?;
        root.present().map_err(plot_err)
    }
}

fn chart<DB: DrawingBackend>(sweep: &Sweep, root: &DrawingArea<DB, Shift>) -> Result<(), String>
where
    DB::ErrorType: 'static,
{
    root.fill(&WHITE).map_err(plot_err)?;
    let (lo, hi) = (
        sweep.rows.first().map_or(1, |r| r.limit),
        sweep
            .rows
            .last()
            .map_or(2, |r| r.limit)
            .max(sweep.rows.first().map_or(1, |r| r.limit) + 1),
    );
    let title = format!("callguard tune: limit N of rule `{}`", sweep.rule);
    let mut c = ChartBuilder::on(root)
        .caption(title, ("sans-serif", 24))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(60)
        .build_cartesian_2d(lo as f64..hi as f64, 0f64..100f64)
        .map_err(plot_err)?;
    c.configure_mesh()
        .x_desc("N (calls allowed in the window)")
        .y_desc("%")
        .draw()
        .map_err(plot_err)?;
    let series = |f: &dyn Fn(&crate::offline::tune::SweepRow) -> Option<f64>| -> Vec<(f64, f64)> {
        sweep
            .rows
            .iter()
            .filter_map(|r| f(r).map(|v| (r.limit as f64, v * 100.0)))
            .collect()
    };
    type Line<'a> = (&'a str, RGBColor, Vec<(f64, f64)>);
    let lines: [Line; 3] = [
        ("calls rejected", BLUE, series(&|r| Some(r.rejected_share))),
        ("recall (fraud calls caught)", GREEN, series(&|r| r.recall)),
        (
            "false-reject rate x100 (legit calls)",
            RED,
            series(&|r| r.false_reject_rate.map(|f| f * 100.0)),
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
    c.configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperRight)
        .draw()
        .map_err(plot_err)?;
    Ok(())
}
