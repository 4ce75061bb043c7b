//! The streamed CSV reader: one thread parses records with the `csv`
//! crate, others decode batches of them, and the batches are put back in
//! file order.

use std::fs::File;
use std::path::Path;

use crate::engine::event::{Decoder, FIELDS};
use crate::error::IoError;
use crate::offline::cdr::{detect, InputFormat, Preset};
use crate::offline::columns::EventColumns;
use crate::progress::progress_bar;

use super::row::{DecodedBatch, RowDecoder, CSV_BATCH};
use super::{
    bad_shape, check_delimiter, check_required, effective_map, preset_names, unclosed_quote_line,
    wanted_columns, InvalidRow, ReadOptions,
};

/// What a CSV-like file's first record tells: how to decode its rows.
struct Header {
    /// The decoder with the format's field mapping.
    decoder: Decoder,
    /// The switch's preset, if the file is a CDR file.
    preset: Option<&'static Preset>,
    /// `fields[i]` is the column of field `FIELDS[i]`, if read.
    fields: [Option<usize>; FIELDS.len()],
    /// The column telling call attempts from other rows (Kamailio's method).
    attempt: Option<usize>,
    /// The first record is a data row, not a header.
    first_is_data: bool,
}

/// Tells a CSV-like file's layout from its first record `first` (as text)
/// and checks that the required columns are there.
fn resolve_header(
    path: &Path,
    opts: &ReadOptions,
    format: InputFormat,
    first: &[String],
) -> Result<Header, IoError> {
    let cells: Vec<&str> = first.iter().map(String::as_str).collect();
    let user = &opts.decoder.map;
    let mapped = [
        user.source("call_id"),
        user.source("caller"),
        user.source("ts"),
    ];
    let layout = detect(format, &cells, &mapped);
    let mut decoder = opts.decoder.clone();
    decoder.map = effective_map(layout.format, user);
    let preset = layout.format.preset();
    let names = match preset {
        Some(p) => preset_names(path, p, layout, first)?,
        None => {
            check_delimiter(path, first, opts.delimiter)?;
            first.to_vec()
        }
    };
    check_required(&decoder, &opts.decoder.map, &names)?;
    let wanted = wanted_columns(&decoder.map, opts);
    let mut fields = [None; FIELDS.len()];
    for (slot, f) in fields.iter_mut().zip(FIELDS) {
        let src = decoder.map.source(f);
        if wanted.contains(&src) {
            *slot = names.iter().position(|n| n == src);
        }
    }
    let attempt = preset
        .and_then(|p| p.attempt)
        .and_then(|(col, _)| names.iter().position(|n| n == col));
    Ok(Header {
        decoder,
        preset,
        fields,
        attempt,
        first_is_data: !layout.header,
    })
}

/// [`read_events`] for CSV files and switches' CDR files.
pub(super) fn read_csv_events(
    path: &Path,
    opts: &ReadOptions,
    format: InputFormat,
    sink: &mut dyn FnMut(EventColumns) -> Result<(), IoError>,
) -> Result<Vec<InvalidRow>, IoError> {
    let io = |source| IoError::Io {
        context: format!("reading {}", path.display()),
        source,
    };
    let file = File::open(path).map_err(io)?;
    let size = file.metadata().map_err(io)?.len();
    let mut reader = csv::ReaderBuilder::new()
        .delimiter(opts.delimiter)
        .has_headers(false)
        .flexible(true)
        .buffer_capacity(1 << 20)
        .from_reader(file);
    let csv_err = |e: csv::Error| bad_shape(path, e.to_string());
    let mut first = csv::ByteRecord::new();
    if !reader.read_byte_record(&mut first).map_err(csv_err)? {
        return Err(bad_shape(path, "no data: empty CSV"));
    }
    let first_text: Vec<String> = first
        .iter()
        .map(|n| String::from_utf8_lossy(n).into_owned())
        .collect();
    let header = resolve_header(path, opts, format, &first_text)?;
    let first = header.first_is_data.then_some(first);
    let bar = progress_bar(size, opts.progress, "reading");
    let decoded = decode_in_order(reader, first, &header, opts, &bar, sink);
    bar.finish_and_clear();
    let decoded = decoded.map_err(csv_err)?;
    if let Some(e) = decoded.sink_error {
        return Err(e);
    }
    check_quotes_closed(path, decoded.last_multiline)?;
    Ok(decoded.invalid)
}

/// What [`decode_in_order`] read (its events went to the sink).
struct Decoded {
    invalid: Vec<InvalidRow>,
    /// The sink's first error: the events after it were read, not taken.
    sink_error: Option<IoError>,
    /// The last record spans lines (an unclosed quote, perhaps).
    last_multiline: bool,
}

/// Parses the records on one thread and decodes batches of them on
/// others, handing the batches to `sink` in file order. `first`: a first
/// record that is data (not a header).
fn decode_in_order<R: std::io::Read + Send>(
    reader: csv::Reader<R>,
    first: Option<csv::ByteRecord>,
    header: &Header,
    opts: &ReadOptions,
    bar: &indicatif::ProgressBar,
    sink: &mut dyn FnMut(EventColumns) -> Result<(), IoError>,
) -> Result<Decoded, csv::Error> {
    let mut out = Decoded {
        invalid: Vec::new(),
        sink_error: None,
        last_multiline: false,
    };
    let workers = std::thread::available_parallelism().map_or(1, |n| n.get().min(4));
    let (full_tx, full_rx) =
        std::sync::mpsc::sync_channel::<(usize, Vec<csv::ByteRecord>)>(2 * workers);
    let full_rx = std::sync::Mutex::new(full_rx);
    let (done_tx, done_rx) = std::sync::mpsc::channel::<DecodedBatch>();
    let (empty_tx, empty_rx) = std::sync::mpsc::channel::<Vec<csv::ByteRecord>>();
    std::thread::scope(|s| {
        let parser = s.spawn(move || parse_batches(reader, first, &full_tx, &empty_rx));
        for _ in 0..workers {
            let (full_rx, done_tx) = (&full_rx, done_tx.clone());
            s.spawn(move || decode_batches(header, opts, full_rx, &done_tx));
        }
        drop(done_tx);
        let mut waiting = std::collections::BTreeMap::new();
        let mut next = 0;
        // Dropped at a sink error: the parser then stops within the
        // batches already in flight.
        let mut empty_tx = Some(empty_tx);
        for decoded in done_rx {
            waiting.insert(decoded.seq, decoded);
            while let Some(d) = waiting.remove(&next) {
                // After a sink error the batches in flight are drained,
                // not taken: the threads finish them either way.
                if out.sink_error.is_none() {
                    out.sink_error = sink(d.events).err();
                    if out.sink_error.is_some() {
                        empty_tx = None;
                    }
                }
                out.invalid.extend(d.invalid);
                if let Some(last) = d.records.last() {
                    out.last_multiline = last.iter().any(|f| f.contains(&b'\n'));
                    bar.set_position(last.position().map_or(0, |p| p.byte()));
                }
                // The parser may have finished (or failed) already.
                if let Some(tx) = &empty_tx {
                    let _ = tx.send(d.records);
                }
                next += 1;
            }
        }
        parser
            .join()
            .unwrap_or_else(|p| std::panic::resume_unwind(p))
    })?;
    Ok(out)
}

/// Batches of records in flight at most (being parsed, decoded, or
/// waiting for the sink): the read runs no further ahead of a slow sink
/// (one spilling a sorted run to disk) than this.
const BATCHES_IN_FLIGHT: usize = 32;

/// The parsing thread: fills batches of [`CSV_BATCH`] records (reusing
/// those that come back, at most [`BATCHES_IN_FLIGHT`] of them) and hands
/// them on, numbered; stops when none come back any more (the sink
/// failed).
fn parse_batches<R: std::io::Read>(
    mut reader: csv::Reader<R>,
    first: Option<csv::ByteRecord>,
    full_tx: &std::sync::mpsc::SyncSender<(usize, Vec<csv::ByteRecord>)>,
    empty_rx: &std::sync::mpsc::Receiver<Vec<csv::ByteRecord>>,
) -> Result<(), csv::Error> {
    let mut made = 1;
    let mut filled = usize::from(first.is_some());
    let mut batch: Vec<csv::ByteRecord> = first.into_iter().collect();
    for seq in 0.. {
        if batch.len() < CSV_BATCH {
            batch.resize_with(CSV_BATCH, csv::ByteRecord::new);
        }
        while filled < CSV_BATCH && reader.read_byte_record(&mut batch[filled])? {
            filled += 1;
        }
        let done = filled < CSV_BATCH;
        batch.truncate(filled);
        if filled > 0 && full_tx.send((seq, batch)).is_err() {
            break;
        }
        if done {
            break;
        }
        // The sink hands each batch back once it took its events; every
        // batch in flight reaches it, so waiting for one cannot stall.
        batch = match empty_rx.try_recv() {
            Ok(b) => b,
            // The sink failed: no more batches are wanted.
            Err(std::sync::mpsc::TryRecvError::Disconnected) => break,
            Err(_) if made < BATCHES_IN_FLIGHT => {
                made += 1;
                Vec::new()
            }
            Err(_) => match empty_rx.recv() {
                Ok(b) => b,
                Err(_) => break,
            },
        };
        filled = 0;
    }
    Ok(())
}

/// A decoding thread: decodes the batches it takes until there are none.
fn decode_batches(
    header: &Header,
    opts: &ReadOptions,
    full_rx: &std::sync::Mutex<std::sync::mpsc::Receiver<(usize, Vec<csv::ByteRecord>)>>,
    done_tx: &std::sync::mpsc::Sender<DecodedBatch>,
) {
    let mut row = RowDecoder::new(
        &header.decoder,
        header.preset,
        opts.timezone,
        opts.ts_format.as_deref(),
    );
    row.attempt_column = header.attempt;
    loop {
        let next = match full_rx.lock() {
            Ok(rx) => rx.recv(),
            Err(_) => return,
        };
        let Ok((seq, batch)) = next else { return };
        if done_tx
            .send(row.decode_records(seq, batch, &header.fields))
            .is_err()
        {
            return;
        }
    }
}

/// A quote that is never closed runs to the end of the file: the last
/// record then spans lines. Says where it opened rather than read the rest
/// of the file as one cell.
fn check_quotes_closed(path: &Path, last_multiline: bool) -> Result<(), IoError> {
    if !last_multiline {
        return Ok(());
    }
    match unclosed_quote_line(path) {
        Some(line) => Err(bad_shape(
            path,
            format!(
                "line {line}: a quoted field is never closed (the rest of the file would be one cell)"
            ),
        )),
        None => Ok(()),
    }
}
