//! polars' CSV reader over call logs: the tests' oracle of the streamed
//! reader (`stream.rs`), which the library uses (`testing` feature).

use std::path::Path;

use polars::prelude::*;

use super::{bad_shape, check_delimiter, polars_err, preset_names, unclosed_quote_line};
use crate::error::IoError;
use crate::offline::cdr::{detect, Preset};

/// The CSV reader's options: every cell as text (no type inference, so a
/// `+34...` or `0034...` number keeps its digits), and rows with more fields
/// than the header cut to the header's width (rows with fewer get nulls: a
/// missing field, listed as an invalid row).
fn csv_options(has_header: bool, delimiter: u8) -> CsvReadOptions {
    CsvReadOptions::default()
        .with_has_header(has_header)
        .with_infer_schema_length(Some(0))
        .with_parse_options(
            CsvParseOptions::default()
                .with_separator(delimiter)
                .with_truncate_ragged_lines(true),
        )
}

/// Reads a CSV file with `options`, turning a polars failure into an error
/// that names the file and, for an unclosed quote, its line. A file with
/// invalid UTF-8 is read again with the bad bytes replaced by U+FFFD (the
/// rows holding them then fail decoding and are listed with their numbers);
/// strict decoding first, as it is markedly faster on clean files.
fn read_csv(path: &Path, options: CsvReadOptions) -> Result<DataFrame, IoError> {
    let ctx = format!("reading {}", path.display());
    let attempt = |options: CsvReadOptions| {
        options
            .try_into_reader_with_file_path(Some(path.into()))
            .and_then(|r| r.finish())
    };
    let read = attempt(options.clone()).or_else(|e| {
        if e.to_string().contains("utf-8") {
            let lossy = options
                .parse_options
                .as_ref()
                .clone()
                .with_encoding(CsvEncoding::LossyUtf8);
            attempt(options.with_parse_options(lossy))
        } else {
            Err(e)
        }
    });
    read.map_err(|source| match unclosed_quote_line(path) {
        Some(line) => IoError::BadShape {
            path: path.to_path_buf(),
            problem: format!(
                "line {line}: a quoted field is never closed (the rest of the file would be one cell)"
            ),
        },
        None => IoError::Polars {
            context: ctx,
            source,
        },
    })
}

/// A plain CSV file with a header as a frame of text columns; with
/// `wanted`, only those of its columns that exist.
pub(super) fn read_csv_frame(
    path: &Path,
    delimiter: u8,
    wanted: Option<&[&str]>,
) -> Result<DataFrame, IoError> {
    // The header alone tells the delimiter is right and which
    // wanted columns exist.
    let header = read_csv(path, csv_options(true, delimiter).with_n_rows(Some(0)))?;
    let names: Vec<String> = header
        .get_column_names()
        .iter()
        .map(|n| n.to_string())
        .collect();
    check_delimiter(path, &names, delimiter)?;
    let columns = match wanted {
        Some(wanted) => {
            let present: Vec<PlSmallStr> = wanted
                .iter()
                .filter(|w| names.iter().any(|n| n == *w))
                .map(|w| (*w).into())
                .collect();
            if present.is_empty() {
                return Err(IoError::MissingColumn {
                    column: wanted.first().copied().unwrap_or("call_id").to_string(),
                    field: "call_id",
                    columns: names.join(", "),
                });
            }
            Some(present.into())
        }
        None => None,
    };
    read_csv(path, csv_options(true, delimiter).with_columns(columns))
}

/// A preset's file as a frame of text columns (the polars reader).
pub(super) fn read_preset_frame(
    path: &Path,
    preset: &Preset,
    delimiter: u8,
) -> Result<DataFrame, IoError> {
    let ctx = format!("reading {}", path.display());
    let mut df = read_csv(path, csv_options(false, delimiter))?;
    let first: Vec<String> = match df.get_row(0) {
        Ok(row) => row
            .0
            .iter()
            .map(|v| v.get_str().unwrap_or_default().to_string())
            .collect(),
        Err(_) => return Err(bad_shape(path, "no data: empty CSV")),
    };
    let cells: Vec<&str> = first.iter().map(String::as_str).collect();
    let layout = detect(preset.format, &cells, &[]);
    let names: Vec<PlSmallStr> = preset_names(path, preset, layout, &first)?
        .into_iter()
        .map(PlSmallStr::from)
        .collect();
    df.set_column_names(&names).map_err(polars_err(ctx))?;
    if layout.header {
        df = df.slice(1, df.height().saturating_sub(1));
    }
    Ok(df)
}
