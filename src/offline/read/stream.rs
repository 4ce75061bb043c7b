//! The streamed CSV reader: one thread cuts the file into batches of
//! records, others decode them, and the batches are put back in file
//! order.
//!
//! Text without quotes and carriage returns (most call logs and CDR
//! exports) is cut into blocks of whole lines, every line a record and
//! every delimiter a field's end: the decoding threads find the fields,
//! and the cutting thread only the ends of lines. From the first block
//! with a quote or a carriage return on, the `csv` crate parses the
//! records (quoted fields, Windows ends of line). Both give the same
//! records in the same batches.

use std::fs::File;
use std::io::Read;
use std::path::Path;

use crate::engine::event::{Decoder, FIELDS};
use crate::error::IoError;
use crate::offline::cdr::{detect, InputFormat, Preset};
use crate::offline::columns::EventColumns;
use crate::progress::progress_bar;

use super::row::{BatchText, DecodedBatch, Line, LineBlock, RowDecoder, CSV_BATCH, LINE_READ};
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
    read_csv_events_by(path, opts, format, Parsing::Fastest, sink)
}

/// How the records after the first are parsed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Parsing {
    /// As lines split at the delimiter while the text has no quote and no
    /// carriage return (the same records, parsed on the decoding threads),
    /// by the `csv` crate from the first block that has one.
    Fastest,
    /// By the `csv` crate throughout.
    #[cfg(test)]
    CsvCrate,
}

/// [`read_csv_events`], parsing as `parsing` says.
pub(super) fn read_csv_events_by(
    path: &Path,
    opts: &ReadOptions,
    format: InputFormat,
    parsing: Parsing,
    sink: &mut dyn FnMut(EventColumns) -> Result<(), IoError>,
) -> Result<Vec<InvalidRow>, IoError> {
    let io = |source| IoError::Io {
        context: format!("reading {}", path.display()),
        source,
    };
    let file = File::open(path).map_err(io)?;
    let size = file.metadata().map_err(io)?.len();
    // The first record is read apart; the reader's buffer goes on to the
    // parsing thread with the file (which may be a pipe: no seeking back).
    let mut reader = csv_reader(
        Recorded {
            file,
            seen: Vec::new(),
        },
        opts.delimiter,
    );
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
    let after_first = reader.position().byte();
    let Recorded { file, mut seen } = reader.into_inner();
    let offset = seen.len() as u64;
    seen.drain(..(after_first as usize).min(seen.len()));
    let rest = Rest {
        file,
        head: seen,
        offset,
        delimiter: opts.delimiter,
        lines: parsing == Parsing::Fastest,
    };
    let bar = progress_bar(size, opts.progress, "reading");
    let decoded = decode_in_order(rest, first, &header, opts, &bar, sink);
    bar.finish_and_clear();
    let decoded = decoded.map_err(csv_err)?;
    if let Some(e) = decoded.sink_error {
        return Err(e);
    }
    check_quotes_closed(path, decoded.last_multiline)?;
    Ok(decoded.invalid)
}

/// The reader of the `csv` crate as callguard reads CSV: no header (the
/// first record is looked at apart), rows of any length.
fn csv_reader<R: Read>(from: R, delimiter: u8) -> csv::Reader<R> {
    csv::ReaderBuilder::new()
        .delimiter(delimiter)
        .has_headers(false)
        .flexible(true)
        .buffer_capacity(1 << 20)
        .from_reader(from)
}

/// A file, and the bytes read from it so far.
struct Recorded {
    file: File,
    seen: Vec<u8>,
}

impl Read for Recorded {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.file.read(buf)?;
        self.seen.extend_from_slice(&buf[..n]);
        Ok(n)
    }
}

/// The file past its first record, for the parsing thread.
struct Rest {
    /// The text after the first record already read from the file.
    head: Vec<u8>,
    file: File,
    /// Where in the file `file` is.
    offset: u64,
    delimiter: u8,
    /// Whether blocks of lines may be handed on (see [`Parsing`]).
    lines: bool,
}

/// What [`decode_in_order`] read (its events went to the sink).
struct Decoded {
    invalid: Vec<InvalidRow>,
    /// The sink's first error: the events after it were read, not taken.
    sink_error: Option<IoError>,
    /// The last record spans lines (an unclosed quote, perhaps).
    last_multiline: bool,
}

/// A batch handed from the parsing thread to a decoding one.
struct Batch {
    /// Its place among the batches.
    seq: usize,
    /// The data row number of its first record.
    first_row: u64,
    /// The byte offset in the file where it ends.
    end: u64,
    text: BatchText,
}

/// Parses the records on one thread and decodes batches of them on
/// others, handing the batches to `sink` in file order. `first`: a first
/// record that is data (not a header).
fn decode_in_order(
    rest: Rest,
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
    let (full_tx, full_rx) = std::sync::mpsc::sync_channel::<Batch>(2 * workers);
    let full_rx = std::sync::Mutex::new(full_rx);
    let (done_tx, done_rx) = std::sync::mpsc::channel::<DecodedBatch>();
    let (empty_tx, empty_rx) = std::sync::mpsc::channel::<BatchText>();
    std::thread::scope(|s| {
        let parser = s.spawn(move || {
            let mut parser = Parser {
                seq: 0,
                row: 1,
                made: 0,
                full_tx,
                empty_rx,
            };
            parser.run(rest, first)
        });
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
                out.last_multiline = d.last_multiline;
                bar.set_position(d.end);
                // The parser may have finished (or failed) already.
                if let Some(tx) = &empty_tx {
                    let _ = tx.send(d.text);
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

/// Batches in flight at most (being parsed, decoded, or waiting for the
/// sink): the read runs no further ahead of a slow sink (one spilling a
/// sorted run to disk) than this.
const BATCHES_IN_FLIGHT: usize = 32;

/// The parsing thread: hands on numbered batches, reusing those that come
/// back (at most [`BATCHES_IN_FLIGHT`] are made); stops when none come
/// back any more (the sink failed).
struct Parser {
    /// The next batch's number.
    seq: usize,
    /// The next record's data row number.
    row: u64,
    /// Batches made so far.
    made: usize,
    full_tx: std::sync::mpsc::SyncSender<Batch>,
    empty_rx: std::sync::mpsc::Receiver<BatchText>,
}

impl Parser {
    /// Parses the rest of the file after `first` (a data record, if not a
    /// header): as blocks of lines while it may, then with the `csv` crate.
    fn run(&mut self, mut rest: Rest, first: Option<csv::ByteRecord>) -> Result<(), csv::Error> {
        if let Some(first) = first {
            if !self.send(rest.offset, BatchText::Records(vec![first])) {
                return Ok(());
            }
        }
        let carry = if rest.lines {
            match self.lines(&mut rest)? {
                Some(carry) => carry,
                None => return Ok(()),
            }
        } else {
            std::mem::take(&mut rest.head)
        };
        let base = rest.offset - carry.len() as u64;
        let reader = csv_reader(std::io::Cursor::new(carry).chain(rest.file), rest.delimiter);
        self.records(reader, base)
    }

    /// Hands on a batch ending at byte `end`; false when the sink failed.
    fn send(&mut self, end: u64, text: BatchText) -> bool {
        let first_row = self.row;
        self.row += match &text {
            BatchText::Records(r) => r.len(),
            BatchText::Lines(b) => b.lines.len(),
        } as u64;
        let batch = Batch {
            seq: self.seq,
            first_row,
            end,
            text,
        };
        self.seq += 1;
        self.full_tx.send(batch).is_ok()
    }

    /// A batch come back to be refilled; `None` when the sink failed.
    fn spare(&mut self) -> Option<BatchText> {
        use std::sync::mpsc::TryRecvError;
        if self.made < BATCHES_IN_FLIGHT {
            match self.empty_rx.try_recv() {
                Ok(text) => return Some(text),
                Err(TryRecvError::Disconnected) => return None,
                Err(TryRecvError::Empty) => {
                    self.made += 1;
                    return Some(BatchText::Records(Vec::new()));
                }
            }
        }
        // Every batch in flight reaches the sink, which hands it back:
        // waiting for one cannot stall.
        self.empty_rx.recv().ok()
    }

    /// Hands on blocks of [`CSV_BATCH`] lines (as many records as a batch
    /// of the `csv` crate's, so the batches are the same either way) until
    /// the end of the file, or until a block holds a quote or a carriage
    /// return: then the text from that block on is given back (the file
    /// then continues after it), to be parsed by the `csv` crate. `None`
    /// when the sink failed.
    fn lines(&mut self, rest: &mut Rest) -> Result<Option<Vec<u8>>, csv::Error> {
        // The text read and not yet handed on starts at `buf[at]`.
        let mut buf = std::mem::take(&mut rest.head);
        let mut at = 0;
        let mut eof = false;
        loop {
            let Some(text) = self.spare() else {
                return Ok(None);
            };
            let mut block = match text {
                BatchText::Lines(b) => b,
                BatchText::Records(_) => LineBlock::default(),
            };
            block.bytes.clear();
            block.lines.clear();
            // Lines are found from `scan`, the next one starting at `start`
            // (both relative to `at`, which moves when `buf` is compacted).
            let (mut scan, mut start) = (at, at);
            while block.lines.len() < CSV_BATCH {
                match memchr::memchr(b'\n', &buf[scan..]) {
                    Some(i) => {
                        let end = scan + i;
                        if end > start {
                            block.lines.push((start - at, end - at));
                        }
                        (scan, start) = (end + 1, end + 1);
                    }
                    None if eof => {
                        // The file's last line may have no end of line.
                        if buf.len() > start {
                            block.lines.push((start - at, buf.len() - at));
                        }
                        start = buf.len();
                        break;
                    }
                    None => {
                        buf.drain(..at);
                        (scan, start, at) = (buf.len(), start - at, 0);
                        eof = read_more(&mut rest.file, &mut buf, &mut rest.offset)?;
                    }
                }
            }
            let text = &buf[at..start];
            if memchr::memchr2(b'"', b'\r', text).is_some() {
                buf.drain(..at);
                return Ok(Some(buf));
            }
            block.bytes.extend_from_slice(text);
            at = start;
            let end = rest.offset - (buf.len() - at) as u64;
            if !block.lines.is_empty() && !self.send(end, BatchText::Lines(block)) {
                return Ok(None);
            }
            if eof && at == buf.len() {
                return Ok(Some(Vec::new()));
            }
        }
    }

    /// Hands on batches of [`CSV_BATCH`] records parsed by the `csv` crate
    /// from `reader`, which starts at byte `base` of the file.
    fn records<R: Read>(
        &mut self,
        mut reader: csv::Reader<R>,
        base: u64,
    ) -> Result<(), csv::Error> {
        loop {
            let Some(text) = self.spare() else {
                return Ok(());
            };
            let mut batch = match text {
                BatchText::Records(r) => r,
                BatchText::Lines(_) => Vec::new(),
            };
            if batch.len() < CSV_BATCH {
                batch.resize_with(CSV_BATCH, csv::ByteRecord::new);
            }
            let mut filled = 0;
            while filled < CSV_BATCH && reader.read_byte_record(&mut batch[filled])? {
                filled += 1;
            }
            let done = filled < CSV_BATCH;
            batch.truncate(filled);
            let end = base + reader.position().byte();
            if filled > 0 && !self.send(end, BatchText::Records(batch)) {
                return Ok(());
            }
            if done {
                return Ok(());
            }
        }
    }
}

/// Reads up to [`LINE_READ`] bytes of `file` onto `buf`; `offset`
/// follows the file. Returns whether the file ended.
fn read_more(file: &mut File, buf: &mut Vec<u8>, offset: &mut u64) -> std::io::Result<bool> {
    let read = file.by_ref().take(LINE_READ as u64).read_to_end(buf)?;
    *offset += read as u64;
    Ok(read == 0)
}

/// A decoding thread: decodes the batches it takes until there are none.
fn decode_batches(
    header: &Header,
    opts: &ReadOptions,
    full_rx: &std::sync::Mutex<std::sync::mpsc::Receiver<Batch>>,
    done_tx: &std::sync::mpsc::Sender<DecodedBatch>,
) {
    let mut row = RowDecoder::new(
        &header.decoder,
        header.preset,
        opts.timezone,
        opts.ts_format.as_deref(),
    );
    row.attempt_column = header.attempt;
    let last = row.last_column(&header.fields);
    loop {
        let next = match full_rx.lock() {
            Ok(rx) => rx.recv(),
            Err(_) => return,
        };
        let Ok(batch) = next else { return };
        let (events, invalid) = match &batch.text {
            BatchText::Records(records) => {
                row.decode_records(batch.first_row, records.iter(), &header.fields)
            }
            BatchText::Lines(block) => row.decode_records(
                batch.first_row,
                block.lines.iter().map(|&(start, end)| {
                    Line::split(&block.bytes[start..end], opts.delimiter, last)
                }),
                &header.fields,
            ),
        };
        let last_multiline = match &batch.text {
            BatchText::Records(records) => records
                .last()
                .is_some_and(|r| r.iter().any(|f| f.contains(&b'\n'))),
            BatchText::Lines(_) => false,
        };
        let decoded = DecodedBatch {
            seq: batch.seq,
            events,
            invalid,
            text: batch.text,
            end: batch.end,
            last_multiline,
        };
        if done_tx.send(decoded).is_err() {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::event::CallEvent;

    /// Reads `text` as a call log, parsed as `parsing` says: each event
    /// with its row number, and the invalid rows.
    fn read(
        text: &[u8],
        opts: &ReadOptions,
        format: InputFormat,
        parsing: Parsing,
    ) -> (Vec<(u64, CallEvent)>, Vec<InvalidRow>) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("calls.csv");
        std::fs::write(&path, text).unwrap();
        let mut events = Vec::new();
        let invalid = read_csv_events_by(&path, opts, format, parsing, &mut |columns| {
            events.extend((0..columns.len()).map(|i| (columns.row(i), columns.event(i))));
            Ok(())
        })
        .unwrap();
        (events, invalid)
    }

    /// The same events, rows and invalid rows by lines as by the `csv`
    /// crate; returns how many events.
    fn same_both_ways(text: &[u8], opts: &ReadOptions, format: InputFormat) -> usize {
        let fast = read(text, opts, format, Parsing::Fastest);
        let csv = read(text, opts, format, Parsing::CsvCrate);
        assert_eq!(fast.0.len(), csv.0.len(), "events");
        for (a, b) in fast.0.iter().zip(&csv.0) {
            assert_eq!(a, b);
        }
        assert_eq!(fast.1, csv.1, "invalid rows");
        fast.0.len()
    }

    /// A quote-free log of `rows` rows over several line blocks, with what
    /// the line path must get right: blank lines, short and long rows,
    /// invalid times and labels, a number that is not UTF-8, empty fields.
    fn awkward_log(rows: usize, delimiter: char) -> Vec<u8> {
        let d = delimiter;
        let mut text =
            format!("call_id{d}caller{d}callee{d}ts{d}duration_ms{d}label\n").into_bytes();
        for i in 0..rows {
            let line = match i % 97 {
                5 => String::new(),
                11 => format!("c{i}{d}+3491{i:07}"),
                17 => format!("c{i}{d}+3491{i:07}{d}{d}not-a-time{d}{d}legit"),
                23 => format!(
                    "c{i}{d}+3491{i:07}{d}+3492{i:07}{d}{}{d}12{d}maybe{d}x{d}y",
                    1_764_547_200_000u64 + i as u64
                ),
                31 => format!(
                    "c{i}{d}{d}+3492{i:07}{d}{}{d}{d}",
                    1_764_547_200_000u64 + i as u64
                ),
                _ => format!(
                    "c{i}{d}+3491{:07}{d}+3492{i:07}{d}2025-12-01T00:{:02}:{:02}.{:03}Z{d}{}{d}{}",
                    i % 5003,
                    (i / 60_000) % 60,
                    (i / 1000) % 60,
                    i % 1000,
                    i % 7_000,
                    if i % 3 == 0 { "fraud" } else { "legit" }
                ),
            };
            text.extend_from_slice(line.as_bytes());
            if i % 97 == 41 {
                text.extend_from_slice(b"\xff\xfe");
            }
            text.push(b'\n');
        }
        text
    }

    #[test]
    fn lines_read_as_the_csv_crate_reads_them() {
        let opts = ReadOptions::default();
        let text = awkward_log(20_000, ',');
        let events = same_both_ways(&text, &opts, InputFormat::Csv);
        assert!(events > 18_000, "{events} events");
        // Without the last end of line, and with one line longer than a
        // block.
        let mut cut = text.clone();
        cut.pop();
        same_both_ways(&cut, &opts, InputFormat::Csv);
        let mut long = awkward_log(3_000, ',');
        long.extend_from_slice(format!("x{}\n", "9".repeat(LINE_READ * 2)).as_bytes());
        long.extend_from_slice(&awkward_log(3_000, ',')[40..]);
        same_both_ways(&long, &opts, InputFormat::Csv);
        // Another delimiter.
        let semi = ReadOptions {
            delimiter: b';',
            ..ReadOptions::default()
        };
        same_both_ways(&awkward_log(5_000, ';'), &semi, InputFormat::Csv);
    }

    #[test]
    fn a_quote_or_a_carriage_return_hands_the_rest_to_the_csv_crate() {
        let opts = ReadOptions::default();
        // A quoted field holding a delimiter and an end of line, blocks
        // into the file: the lines before it are read as lines, the rest
        // by the csv crate, and the rows are numbered on.
        let mut text = awkward_log(12_000, ',');
        text.extend_from_slice(b"\"q1\",\"+34911\",\"+34,92\n2\",1764547200000,5,legit\n");
        text.extend_from_slice(&awkward_log(4_000, ',')[40..]);
        let (fast, _) = read(&text, &opts, InputFormat::Csv, Parsing::Fastest);
        assert!(fast.iter().any(|(_, e)| e.call_id == "q1"));
        same_both_ways(&text, &opts, InputFormat::Csv);
        // Windows ends of line throughout, and one stray carriage return.
        let crlf: Vec<u8> = awkward_log(6_000, ',')
            .split(|&b| b == b'\n')
            .flat_map(|l| l.iter().copied().chain(*b"\r\n"))
            .collect();
        same_both_ways(&crlf, &opts, InputFormat::Csv);
        let mut stray = awkward_log(6_000, ',');
        let at = stray.len() / 2;
        stray.insert(at, b'\r');
        same_both_ways(&stray, &opts, InputFormat::Csv);
    }

    #[test]
    fn the_rows_after_the_header_are_read_from_where_it_ends() {
        // The header's own reader reads ahead; the rest starts where the
        // header ends, whatever ends it (a byte order mark before it too).
        let opts = ReadOptions::default();
        for (start, end) in [
            ("", "\n"),
            ("\u{feff}", "\n"),
            ("", "\r\n"),
            ("\u{feff}", "\r\n"),
        ] {
            let mut text = format!("{start}call_id,caller,ts{end}");
            for i in 0..3 {
                text.push_str(&format!("c{i},+3491000000{i},176454720000{i}{end}"));
            }
            for parsing in [Parsing::Fastest, Parsing::CsvCrate] {
                let (events, invalid) = read(text.as_bytes(), &opts, InputFormat::Csv, parsing);
                let got: Vec<(u64, &str)> = events
                    .iter()
                    .map(|(n, e)| (*n, e.call_id.as_str()))
                    .collect();
                assert_eq!(
                    got,
                    [(1, "c0"), (2, "c1"), (3, "c2")],
                    "{start:?} {end:?} {parsing:?}"
                );
                assert!(invalid.is_empty(), "{invalid:?}");
            }
        }
    }

    #[test]
    fn a_file_whose_first_row_is_data_keeps_it() {
        // Kamailio's acc export has no header: its first row is data, and
        // its method column says which rows are call attempts.
        let opts = ReadOptions::default();
        let golden = std::fs::read("tests/golden/kamailio-acc.csv").unwrap();
        same_both_ways(&golden, &opts, InputFormat::Auto);
        let mut rows = Vec::new();
        for i in 0..12_000u64 {
            let method = if i % 5 == 4 { "BYE" } else { "INVITE" };
            rows.extend_from_slice(
                format!(
                    "{method},t{i},,id{i}@pbx.example,200,OK,2025-03-30 0{}:{:02}:{:02},+3491{:07},+3460{i:07},127.0.0.1\n",
                    i / 3600,
                    (i / 60) % 60,
                    i % 60,
                    i % 700
                )
                .as_bytes(),
            );
        }
        let kept = same_both_ways(&rows, &opts, InputFormat::Auto);
        assert_eq!(kept, 12_000 / 5 * 4, "the INVITE rows");
        let (events, _) = read(&rows, &opts, InputFormat::Auto, Parsing::Fastest);
        assert_eq!(events[0], (1, events[0].1.clone()));
        assert_eq!(events[0].1.call_id, "id0@pbx.example");
    }
}
