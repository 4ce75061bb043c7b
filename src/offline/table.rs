//! Writing tables: decision and feature records (built from the one
//! [`RecordSchema`]), sweeps and invalid rows, as CSV or Parquet.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use polars::prelude::*;
use polars_utils::compression::ZstdLevel;

use crate::engine::record::{Kind, Row, Schema as RecordSchema, Value};
use crate::error::IoError;
use crate::offline::read::{polars_err, InvalidRow};

/// A table of `schema`'s columns, one row per decided call; its schema
/// (`frame(schema, &[])`) is what a [`TableWriter`] is created with.
///
/// Built in one pass over the rows, every column filled from each row in
/// turn: a chunk of verdicts is larger than the caches, and a pass per
/// column would read it from memory once per column.
pub fn frame(schema: &RecordSchema, rows: &[Row<'_>]) -> Result<DataFrame, IoError> {
    let mut builders: Vec<Builder> = schema
        .columns()
        .iter()
        .map(|c| Builder::new(c.field.kind(), c.name.as_str().into(), rows.len()))
        .collect();
    for row in rows {
        for (c, b) in schema.columns().iter().zip(&mut builders) {
            b.push(c.field.value(*row));
        }
    }
    let columns = builders.into_iter().map(Builder::finish).collect();
    DataFrame::new(rows.len(), columns).map_err(polars_err("building a table"))
}

/// One column being built, by [`Kind`]: each value goes straight into
/// its column's arrays.
enum Builder {
    Text(StringChunkedBuilder),
    Int(PrimitiveChunkedBuilder<Int64Type>),
    UInt(PrimitiveChunkedBuilder<UInt64Type>),
    Bool(BooleanChunkedBuilder),
    Time(PlSmallStr, Vec<i64>),
    Float(PrimitiveChunkedBuilder<Float32Type>),
}

impl Builder {
    fn new(kind: Kind, name: PlSmallStr, rows: usize) -> Self {
        match kind {
            Kind::Text => Builder::Text(StringChunkedBuilder::new(name, rows)),
            Kind::Int => Builder::Int(PrimitiveChunkedBuilder::new(name, rows)),
            Kind::UInt => Builder::UInt(PrimitiveChunkedBuilder::new(name, rows)),
            Kind::Bool => Builder::Bool(BooleanChunkedBuilder::new(name, rows)),
            Kind::Time => Builder::Time(name, Vec::with_capacity(rows)),
            Kind::Float => Builder::Float(PrimitiveChunkedBuilder::new(name, rows)),
        }
    }

    /// Appends a value; one of another kind (never produced by a field of
    /// this column's kind) appends a null.
    fn push(&mut self, value: Value<'_>) {
        match (self, value) {
            (Builder::Text(b), Value::Text(x)) => b.append_option(x),
            (Builder::Text(b), _) => b.append_null(),
            (Builder::Int(b), Value::Int(x)) => b.append_option(x),
            (Builder::Int(b), _) => b.append_null(),
            (Builder::UInt(b), Value::UInt(x)) => b.append_option(x),
            (Builder::UInt(b), _) => b.append_null(),
            (Builder::Bool(b), Value::Bool(x)) => b.append_option(x),
            (Builder::Bool(b), _) => b.append_null(),
            (Builder::Time(_, v), Value::Time(x)) => v.push(x),
            (Builder::Time(_, v), _) => v.push(0),
            (Builder::Float(b), Value::Float(x)) => b.append_option(x),
            (Builder::Float(b), _) => b.append_null(),
        }
    }

    fn finish(self) -> Column {
        match self {
            Builder::Text(b) => b.finish().into_column(),
            Builder::Int(b) => b.finish().into_column(),
            Builder::UInt(b) => b.finish().into_column(),
            Builder::Bool(b) => b.finish().into_column(),
            Builder::Float(b) => b.finish().into_column(),
            // The epoch milliseconds are the column's values as they are
            // (a cast would convert each one through the time zone).
            Builder::Time(name, v) => Int64Chunked::from_vec(name, v)
                .into_datetime(TimeUnit::Milliseconds, Some(TimeZone::UTC))
                .into_column(),
        }
    }
}

/// How CSV tables write times: RFC 3339 in UTC with milliseconds and the
/// `Z` suffix (`2025-12-01T00:00:01.185Z`), the text the topics carry.
/// Every time callguard writes is UTC (see [`Builder::finish`]), so the
/// suffix is always true.
const CSV_TIME_FORMAT: &str = "%Y-%m-%dT%H:%M:%S%.3fZ";

/// Output formats of tables.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TableFormat {
    /// CSV with a header.
    Csv,
    /// Parquet (zstd).
    Parquet,
}

impl TableFormat {
    /// By extension: `.csv` is CSV, `.parquet` Parquet (either case); any
    /// other extension, or none, is an error naming the two, so that
    /// `-o decisions.json` is not silently written as CSV.
    pub fn from_path(path: &Path) -> Result<Self, IoError> {
        let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
        if ext.eq_ignore_ascii_case("csv") {
            Ok(TableFormat::Csv)
        } else if ext.eq_ignore_ascii_case("parquet") {
            Ok(TableFormat::Parquet)
        } else {
            Err(IoError::UnknownExtension {
                path: path.to_path_buf(),
                expected: ".csv or .parquet",
            })
        }
    }
}

/// A file written under a temporary name beside its final path and renamed
/// over it once complete: a failed run leaves the previous file (or none),
/// never a truncated one. Dropped before [`Staged::commit`], the temporary
/// file is removed.
pub struct Staged {
    tmp: tempfile::NamedTempFile,
    path: PathBuf,
}

impl Staged {
    /// Creates the temporary file for `path`; returns it and a handle to write.
    pub fn create(path: &Path) -> Result<(Self, File), IoError> {
        let io = |source| IoError::Io {
            context: format!("writing {}", path.display()),
            source,
        };
        let dir = path
            .parent()
            .filter(|d| !d.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        let name = path
            .file_name()
            .map_or_else(|| "output".into(), |n| n.to_string_lossy());
        let prefix = format!(".{name}.");
        let mut builder = tempfile::Builder::new();
        builder.prefix(&prefix).suffix(".part");
        // `0666`, from which the kernel takes the umask at creation, as for
        // any file a Unix tool writes: a temporary file's own `0600` would
        // make every output private whatever the umask.
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            builder.permissions(std::fs::Permissions::from_mode(0o666));
        }
        let tmp = builder.tempfile_in(dir).map_err(io)?;
        let file = tmp.as_file().try_clone().map_err(io)?;
        Ok((
            Staged {
                tmp,
                path: path.to_path_buf(),
            },
            file,
        ))
    }

    /// Renames the complete file to its final path.
    pub fn commit(self) -> Result<(), IoError> {
        let path = self.path;
        self.tmp
            .persist(&path)
            .map(|_| ())
            .map_err(|e| IoError::Io {
                context: format!("writing {}", path.display()),
                source: e.error,
            })
    }
}

/// Parquet files are zstd-compressed at level 1: against the default
/// (3), writing a call log's tables takes markedly less CPU for files a few
/// percent larger (measurements in BENCHMARKS.md).
fn parquet_compression() -> ParquetCompression {
    ParquetCompression::Zstd(ZstdLevel::try_new(1).ok())
}

/// Whether a batched table's columns are encoded in parallel (polars'
/// thread pool) rather than one after another on the writer's thread.
/// On two cores the store's shards, the log's reader and the writer keep
/// both busy already: encoding in parallel only added hand-offs, and held
/// every column's pages at once (the 3 M-row feature table: 3% more CPU
/// and 13% more peak memory; BENCHMARKS.md). With more cores the shards
/// finish sooner and the writer alone would be the slowest stage.
fn encode_in_parallel() -> bool {
    std::thread::available_parallelism().is_ok_and(|n| n.get() > 2)
}

/// Bytes a table's file is written in: polars' Parquet writer writes each
/// page's header, levels and values apart, about 130 bytes a write, which
/// as system calls took a fifth of a feature table's CPU (BENCHMARKS.md).
const WRITE_BUFFER: usize = 1 << 20;

/// A buffered handle on a staged file, shared by the writer it is handed
/// to and its owner: polars' batched writers keep their writer to the end,
/// so the owner flushes the buffer after the last write, where a failure
/// (a full disk) is still reported rather than lost in a drop.
#[derive(Clone)]
struct SharedFile(Arc<Mutex<BufWriter<File>>>);

impl SharedFile {
    fn new(file: File) -> Self {
        SharedFile(Arc::new(Mutex::new(BufWriter::with_capacity(
            WRITE_BUFFER,
            file,
        ))))
    }

    fn with<R>(
        &self,
        f: impl FnOnce(&mut BufWriter<File>) -> std::io::Result<R>,
    ) -> std::io::Result<R> {
        let mut file = self
            .0
            .lock()
            .map_err(|_| std::io::Error::other("a table writer panicked"))?;
        f(&mut file)
    }
}

impl Write for SharedFile {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.with(|f| f.write(buf))
    }

    fn write_all(&mut self, buf: &[u8]) -> std::io::Result<()> {
        self.with(|f| f.write_all(buf))
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.with(BufWriter::flush)
    }
}

/// Writes a frame as CSV or Parquet, chosen by the file extension.
pub fn write_frame(path: &Path, df: &mut DataFrame) -> Result<(), IoError> {
    let ctx = format!("writing {}", path.display());
    let format = TableFormat::from_path(path)?;
    let (staged, file) = Staged::create(path)?;
    let mut file = BufWriter::with_capacity(WRITE_BUFFER, file);
    match format {
        TableFormat::Csv => CsvWriter::new(&mut file)
            .include_header(true)
            .with_datetime_format(Some(CSV_TIME_FORMAT.into()))
            .finish(df)
            .map_err(polars_err(ctx.clone()))?,
        TableFormat::Parquet => {
            ParquetWriter::new(&mut file)
                .with_compression(parquet_compression())
                .finish(df)
                .map_err(polars_err(ctx.clone()))?;
        }
    }
    file.flush().map_err(|source| IoError::Io {
        context: ctx,
        source,
    })?;
    staged.commit()
}

/// Writes a table a batch at a time, as CSV or Parquet by the file extension
/// (a Parquet row group per batch), so a large output is never one frame.
pub struct TableWriter {
    inner: TableSink,
    file: SharedFile,
    staged: Staged,
    context: String,
    rows: u64,
}

enum TableSink {
    Csv(polars::io::csv::write::BatchedWriter<SharedFile>),
    Parquet(Box<polars::io::parquet::write::BatchedWriter<SharedFile>>),
}

impl TableWriter {
    /// Creates `path` for tables of `schema` (written under a temporary
    /// name until [`TableWriter::finish`]; see [`Staged`]).
    pub fn create(path: &Path, schema: &Schema) -> Result<Self, IoError> {
        let context = format!("writing {}", path.display());
        let format = TableFormat::from_path(path)?;
        let (staged, file) = Staged::create(path)?;
        let file = SharedFile::new(file);
        let inner = match format {
            TableFormat::Csv => TableSink::Csv(
                CsvWriter::new(file.clone())
                    .include_header(true)
                    .with_datetime_format(Some(CSV_TIME_FORMAT.into()))
                    .batched(schema)
                    .map_err(polars_err(context.clone()))?,
            ),
            TableFormat::Parquet => TableSink::Parquet(Box::new(
                ParquetWriter::new(file.clone())
                    .with_compression(parquet_compression())
                    .set_parallel(encode_in_parallel())
                    .batched(schema)
                    .map_err(polars_err(context.clone()))?,
            )),
        };
        Ok(TableWriter {
            inner,
            file,
            staged,
            context,
            rows: 0,
        })
    }

    /// Appends a batch (same schema as at creation).
    pub fn write(&mut self, df: &mut DataFrame) -> Result<(), IoError> {
        if df.height() == 0 {
            return Ok(());
        }
        df.align_chunks();
        match &mut self.inner {
            TableSink::Csv(w) => w.write_batch(df),
            TableSink::Parquet(w) => w.write_batch(df),
        }
        .map_err(polars_err(self.context.clone()))?;
        self.rows += df.height() as u64;
        Ok(())
    }

    /// Completes the file (header or footer); returns the rows written.
    pub fn finish(mut self) -> Result<u64, IoError> {
        match &mut self.inner {
            TableSink::Csv(w) => w.finish(),
            TableSink::Parquet(w) => w.finish().map(|_| ()),
        }
        .map_err(polars_err(self.context.clone()))?;
        drop(self.inner);
        self.file.flush().map_err(|source| IoError::Io {
            context: self.context.clone(),
            source,
        })?;
        self.staged.commit()?;
        Ok(self.rows)
    }
}

/// A [`TableWriter`] on a thread of its own: each item is turned into a
/// batch (`build`) and written there while the sender goes on, at most two
/// items behind. The file is complete (renamed to its path) only after
/// [`BackgroundWriter::finish`]; dropped before that, it is discarded.
pub struct BackgroundWriter<T> {
    tx: Option<std::sync::mpsc::SyncSender<Batch<T>>>,
    handle: Option<std::thread::JoinHandle<Result<u64, IoError>>>,
}

/// What the writer thread receives.
enum Batch<T> {
    /// The next item.
    Item(T),
    /// Everything was sent: complete the file.
    Done,
}

impl<T: Send + 'static> BackgroundWriter<T> {
    /// Creates `path` for tables of `schema` and starts the writer thread.
    pub fn spawn(
        path: &Path,
        schema: &Schema,
        mut build: impl FnMut(T) -> Result<DataFrame, IoError> + Send + 'static,
    ) -> Result<Self, IoError> {
        let mut out = TableWriter::create(path, schema)?;
        let (tx, rx) = std::sync::mpsc::sync_channel::<Batch<T>>(2);
        let handle = std::thread::spawn(move || {
            for batch in rx {
                match batch {
                    Batch::Item(item) => out.write(&mut build(item)?)?,
                    Batch::Done => return out.finish(),
                }
            }
            // The sender went away without finishing (its run failed): the
            // staged file is dropped, the previous output stays.
            Err(IoError::WorkerLost("table writer"))
        });
        Ok(BackgroundWriter {
            tx: Some(tx),
            handle: Some(handle),
        })
    }

    /// Hands over the next item; if the writer has failed, its error.
    pub fn send(&mut self, item: T) -> Result<(), IoError> {
        let sent = self
            .tx
            .as_ref()
            .is_some_and(|tx| tx.send(Batch::Item(item)).is_ok());
        if sent {
            return Ok(());
        }
        self.tx = None;
        match self.join() {
            Err(e) => Err(e),
            Ok(_) => Err(IoError::WorkerLost("table writer")),
        }
    }

    /// Waits for every batch to be written; returns the rows written.
    pub fn finish(mut self) -> Result<u64, IoError> {
        if let Some(tx) = self.tx.take() {
            // A failed writer has hung up already: join reports why.
            let _ = tx.send(Batch::Done);
        }
        self.join()
    }

    fn join(&mut self) -> Result<u64, IoError> {
        match self.handle.take().map(|h| h.join()) {
            Some(Ok(result)) => result,
            Some(Err(_)) | None => Err(IoError::WorkerLost("table writer")),
        }
    }
}

impl<T> Drop for BackgroundWriter<T> {
    /// Dropped unfinished (the run failed): hangs up and waits for the
    /// writer thread to discard its staged file, so nothing is left behind
    /// once the run has returned.
    fn drop(&mut self) {
        self.tx = None;
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// Writes invalid rows (`row`, `error_kind`, `error`, and `kept`: true for
/// a call kept without the field the error names) next to an output file
/// (`decisions.csv` → `decisions.invalid.csv`); returns the path, if any were written.
/// With none, an earlier run's list at that path is removed: left there, it
/// would read as this run's.
pub fn write_invalid(output: &Path, invalid: &[InvalidRow]) -> Result<Option<PathBuf>, IoError> {
    let stem = output
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "output".into());
    let path = output.with_file_name(format!("{stem}.invalid.csv"));
    if invalid.is_empty() {
        return match std::fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(IoError::Io {
                context: format!("removing the earlier run's {}", path.display()),
                source: e,
            }),
            _ => Ok(None),
        };
    }
    let mut df = DataFrame::new(
        invalid.len(),
        vec![
            Column::new(
                "row".into(),
                invalid.iter().map(|r| r.row).collect::<Vec<u64>>(),
            ),
            Column::new(
                "error_kind".into(),
                invalid
                    .iter()
                    .map(|r| r.error.kind())
                    .collect::<Vec<&str>>(),
            ),
            Column::new(
                "error".into(),
                invalid
                    .iter()
                    .map(|r| r.error.to_string())
                    .collect::<Vec<String>>(),
            ),
            Column::new(
                "kept".into(),
                invalid.iter().map(|r| r.kept).collect::<Vec<bool>>(),
            ),
        ],
    )
    .map_err(polars_err("building the invalid-rows table"))?;
    let ctx = format!("writing {}", path.display());
    let (staged, file) = Staged::create(&path)?;
    CsvWriter::new(file)
        .include_header(true)
        .finish(&mut df)
        .map_err(polars_err(ctx))?;
    staged.commit()?;
    Ok(Some(path))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(n: i64) -> DataFrame {
        DataFrame::new(1, vec![Column::new("n".into(), vec![n])]).unwrap()
    }

    /// A Parquet table larger than the write buffer, in many batches, is
    /// read back whole: the buffer is flushed after the footer.
    #[test]
    fn a_parquet_table_larger_than_the_buffer_is_written_whole() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("big.parquet");
        // Values that do not compress, so the file outgrows the buffer.
        let values = |b: u64| -> Vec<u64> {
            (0..20_000u64)
                .map(|i| (b * 20_000 + i).wrapping_mul(0x9E37_79B9_7F4A_7C15))
                .collect()
        };
        let frame_of =
            |b: u64| DataFrame::new(20_000, vec![Column::new("v".into(), values(b))]).unwrap();
        let mut w = TableWriter::create(&path, frame_of(0).schema()).unwrap();
        for b in 0..10 {
            w.write(&mut frame_of(b)).unwrap();
        }
        assert_eq!(w.finish().unwrap(), 200_000);
        let size = std::fs::metadata(&path).unwrap().len();
        assert!(size > WRITE_BUFFER as u64, "{size} bytes");
        let back = ParquetReader::new(File::open(&path).unwrap())
            .finish()
            .unwrap();
        let expected: Vec<u64> = (0..10).flat_map(values).collect();
        let got: Vec<u64> = back
            .column("v")
            .unwrap()
            .u64()
            .unwrap()
            .into_no_null_iter()
            .collect();
        assert_eq!(got, expected);
    }

    /// Run as a child of the test below (`CALLGUARD_FSIZE_CHILD`): files
    /// may not outgrow 64 KiB, and a table of 160 KB (Parquet) or 400 KB
    /// (CSV), which fits the write buffer whole, fails at its last flush.
    #[cfg(target_os = "linux")]
    #[test]
    fn child_reports_a_failed_last_flush() {
        if std::env::var_os("CALLGUARD_FSIZE_CHILD").is_none() {
            return;
        }
        // SAFETY: plain integers and a struct of ours: a write past the
        // limit then fails with EFBIG rather than end the process.
        unsafe {
            libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
            let limit = libc::rlimit {
                rlim_cur: 64 << 10,
                rlim_max: 64 << 10,
            };
            assert_eq!(libc::setrlimit(libc::RLIMIT_FSIZE, &limit), 0);
        }
        let dir = tempfile::tempdir().unwrap();
        let values: Vec<u64> = (0..20_000u64)
            .map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15))
            .collect();
        let mut df = DataFrame::new(20_000, vec![Column::new("v".into(), values)]).unwrap();
        for name in ["full.parquet", "full.csv"] {
            let path = dir.path().join(name);
            let mut w = TableWriter::create(&path, df.schema()).unwrap();
            w.write(&mut df).unwrap();
            let err = w.finish().unwrap_err().to_string();
            assert!(err.contains(name), "{err}");
            assert!(!path.exists(), "a truncated {name} was left at its path");
        }
        println!("FLUSH FAILURE REPORTED");
    }

    /// A table whose last bytes cannot be written (a full disk, a file
    /// size limit) is an error, and leaves no file at its path.
    #[cfg(target_os = "linux")]
    #[test]
    fn a_failed_last_flush_is_reported_and_leaves_no_table() {
        crate::child_test::passes_in_child(
            "offline::table::tests::child_reports_a_failed_last_flush",
            &[("CALLGUARD_FSIZE_CHILD", "1")],
            "FLUSH FAILURE REPORTED",
        );
    }

    #[test]
    fn background_writer_writes_in_order_and_reports_failures() {
        let dir = tempfile::tempdir().unwrap();
        let schema = batch(0).schema().as_ref().clone();
        let path = dir.path().join("ok.csv");
        let mut w = BackgroundWriter::spawn(&path, &schema, |n: i64| Ok(batch(n))).unwrap();
        for n in 0..100 {
            w.send(n).unwrap();
        }
        assert_eq!(w.finish().unwrap(), 100);
        let text = std::fs::read_to_string(&path).unwrap();
        let expected: String = std::iter::once("n".to_string())
            .chain((0..100).map(|n| n.to_string()))
            .map(|l| l + "\n")
            .collect();
        assert_eq!(text, expected);

        // A batch that cannot be built stops the writer; the sender learns why.
        let path = dir.path().join("bad.csv");
        let mut w = BackgroundWriter::spawn(&path, &schema, |n: i64| {
            if n == 3 {
                Err(IoError::Io {
                    context: "batch 3 is bad".into(),
                    source: std::io::Error::other("bad"),
                })
            } else {
                Ok(batch(n))
            }
        })
        .unwrap();
        let mut first_error = None;
        for n in 0..50 {
            if let Err(e) = w.send(n) {
                first_error = Some(e.to_string());
                break;
            }
        }
        let reported = match first_error {
            Some(e) => e,
            None => w.finish().unwrap_err().to_string(),
        };
        assert_eq!(reported, "batch 3 is bad");

        // Dropped unfinished (a failed run), it leaves no staged file behind
        // by the time the drop returns.
        let path = dir.path().join("dropped.csv");
        let mut w = BackgroundWriter::spawn(&path, &schema, |n: i64| Ok(batch(n))).unwrap();
        for n in 0..10 {
            w.send(n).unwrap();
        }
        drop(w);
        let left: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.contains("dropped"))
            .collect();
        assert!(left.is_empty(), "left behind: {left:?}");
    }
}
