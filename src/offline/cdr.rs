//! Call detail records as switches write them: the Asterisk, FreeSWITCH
//! and Kamailio presets, and telling them apart from the first line.
//!
//! A preset names a switch's columns (in file order, for files without a
//! header), which of them are the call's id, caller, time, callee and
//! duration, and the units they are written in. Times are the switch's
//! local time (`--timezone`); durations are whole seconds, read as
//! milliseconds: the call's whole duration (`duration`, attempt to
//! hang-up) as `duration_ms`, so the call ends at `ts + duration_ms`, and
//! its talk time (`billsec`, 0 for an unanswered call) as `talk_ms`.

use chrono::NaiveDateTime;

/// The layout of an input file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InputFormat {
    /// By file extension and first line: `.parquet` is Parquet; a CSV whose
    /// first line is neither a header with the mapped columns nor a
    /// header of a preset is tried against each preset's rows.
    Auto,
    /// CSV with a header row.
    Csv,
    /// Parquet.
    Parquet,
    /// Asterisk `Master.csv` (cdr_csv).
    Asterisk,
    /// FreeSWITCH `mod_cdr_csv` with its default ("example") template.
    FreeSwitch,
    /// Kamailio `acc` records (the module's columns and the `src_user`,
    /// `dst_user`, `src_ip` extras), as its CSV or database export.
    KamailioAcc,
}

/// What a switch's call records look like.
#[derive(Debug)]
pub struct Preset {
    /// The format it is.
    pub format: InputFormat,
    /// How messages name it ("an Asterisk Master.csv").
    pub label: &'static str,
    /// Column names in file order, when the file has no header.
    pub columns: &'static [&'static str],
    /// Fewest columns a headerless row may have (those up to the last
    /// mapped one).
    pub min_width: usize,
    /// Field to column: call_id, caller, ts, callee, duration_ms (the
    /// call's whole duration, attempt to hang-up), talk_ms (its talk
    /// time, with its unit as `--map` takes it), account.
    pub map: [(&'static str, &'static str); 7],
    /// Integer times are epoch seconds (else milliseconds, as in CSV).
    pub ts_seconds: bool,
    /// The duration column counts seconds.
    pub duration_seconds: bool,
    /// Only rows whose column `.0` holds `.1` are call attempts (Kamailio
    /// logs every transaction: BYE, CANCEL, ...). Other rows are listed as
    /// invalid with that reason.
    pub attempt: Option<(&'static str, &'static str)>,
    /// Whether a headerless first row has this preset's shape.
    looks_like: fn(&[&str]) -> bool,
}

/// Asterisk `Master.csv`: no header, rows written at hangup.
pub const ASTERISK: Preset = Preset {
    format: InputFormat::Asterisk,
    label: "an Asterisk Master.csv",
    columns: &[
        "accountcode",
        "src",
        "dst",
        "dcontext",
        "clid",
        "channel",
        "dstchannel",
        "lastapp",
        "lastdata",
        "start",
        "answer",
        "end",
        "duration",
        "billsec",
        "disposition",
        "amaflags",
        "uniqueid",
        "userfield",
    ],
    min_width: 18,
    map: [
        ("call_id", "uniqueid"),
        ("caller", "src"),
        ("ts", "start"),
        ("callee", "dst"),
        ("duration_ms", "duration"),
        ("talk_ms", "billsec:s"),
        ("account", "accountcode"),
    ],
    ts_seconds: true,
    duration_seconds: true,
    attempt: None,
    looks_like: |c| c.len() >= 18 && is_local_time(c[9]) && !c[16].trim().is_empty(),
};

/// FreeSWITCH `mod_cdr_csv`, default template: no header, every field quoted.
pub const FREESWITCH: Preset = Preset {
    format: InputFormat::FreeSwitch,
    label: "a FreeSWITCH mod_cdr_csv file (default template)",
    columns: &[
        "caller_id_name",
        "caller_id_number",
        "destination_number",
        "context",
        "start_stamp",
        "answer_stamp",
        "end_stamp",
        "duration",
        "billsec",
        "hangup_cause",
        "uuid",
        "bleg_uuid",
        "accountcode",
        "read_codec",
        "write_codec",
    ],
    min_width: 11,
    map: [
        ("call_id", "uuid"),
        ("caller", "caller_id_number"),
        ("ts", "start_stamp"),
        ("callee", "destination_number"),
        ("duration_ms", "duration"),
        ("talk_ms", "billsec:s"),
        ("account", "accountcode"),
    ],
    ts_seconds: true,
    duration_seconds: true,
    attempt: None,
    looks_like: |c| {
        c.len() >= 11
            && is_local_time(c[4])
            && is_integer(c[7])
            && is_integer(c[8])
            && !c[10].trim().is_empty()
    },
};

/// Kamailio `acc`: one row per transaction, the caller and callee in the
/// `src_user`/`dst_user` extras.
pub const KAMAILIO_ACC: Preset = Preset {
    format: InputFormat::KamailioAcc,
    label: "a Kamailio acc file (method, from_tag, to_tag, callid, sip_code, sip_reason, time, src_user, dst_user[, src_ip])",
    columns: &[
        "method",
        "from_tag",
        "to_tag",
        "callid",
        "sip_code",
        "sip_reason",
        "time",
        "src_user",
        "dst_user",
        "src_ip",
    ],
    min_width: 9,
    map: [
        ("call_id", "callid"),
        ("caller", "src_user"),
        ("ts", "time"),
        ("callee", "dst_user"),
        // acc has no duration, talk time nor account (the dialog
        // module's CDRs do).
        ("duration_ms", "duration"),
        ("talk_ms", "billsec:s"),
        ("account", "accountcode"),
    ],
    ts_seconds: true,
    duration_seconds: true,
    attempt: Some(("method", "INVITE")),
    looks_like: |c| {
        c.len() >= 9
            && is_sip_method(c[0])
            && c[4].trim().len() == 3
            && is_integer(c[4])
            && (is_local_time(c[6]) || is_integer(c[6]))
    },
};

/// Every preset, in the order detection tries them.
pub const PRESETS: [&Preset; 3] = [&ASTERISK, &FREESWITCH, &KAMAILIO_ACC];

impl InputFormat {
    /// The format's preset, if it is a switch's.
    pub fn preset(self) -> Option<&'static Preset> {
        PRESETS.iter().copied().find(|p| p.format == self)
    }
}

impl Preset {
    /// Whether `first` (a file's first record) is this preset's header: it
    /// names the preset's call id, caller and time columns.
    pub fn is_header(&self, first: &[&str]) -> bool {
        self.map[..3]
            .iter()
            .all(|(_, col)| first.iter().any(|c| c.trim().eq_ignore_ascii_case(col)))
    }

    /// Column names for a headerless file of rows `width` wide (the known
    /// ones, then `extra_<i>`); `None` when rows are narrower than the
    /// preset needs.
    pub fn names(&self, width: usize) -> Option<Vec<String>> {
        (width >= self.min_width).then(|| {
            (0..width)
                .map(|i| {
                    self.columns
                        .get(i)
                        .map_or_else(|| format!("extra_{i}"), |n| (*n).to_string())
                })
                .collect()
        })
    }

    /// The field mapping entries `FIELD=COLUMN` of this preset.
    pub fn map_entries(&self) -> String {
        let pairs: Vec<String> = self.map.iter().map(|(f, c)| format!("{f}={c}")).collect();
        pairs.join(",")
    }
}

/// A file's layout once its first line is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    /// The format (never `Auto`).
    pub format: InputFormat,
    /// The first line is a header (always so for plain CSV).
    pub header: bool,
}

/// Tells the layout of a CSV-like file from its first record: a header
/// naming `mapped` (the user's call id, caller and time columns) is plain
/// CSV; a header naming a preset's columns, or a row shaped like a
/// preset's, is that preset; anything else is plain CSV (whose reader then
/// names the missing column). With an explicit preset, only whether the
/// first line is a header is told.
pub fn detect(format: InputFormat, first: &[&str], mapped: &[&str]) -> Layout {
    let names_all = |cols: &[&str]| {
        cols.iter()
            .all(|m| first.iter().any(|c| c.trim().eq_ignore_ascii_case(m)))
    };
    match format.preset() {
        Some(p) => Layout {
            format,
            header: p.is_header(first),
        },
        None if format != InputFormat::Auto || names_all(mapped) => Layout {
            format: if format == InputFormat::Auto {
                InputFormat::Csv
            } else {
                format
            },
            header: true,
        },
        None => {
            if let Some(p) = PRESETS.iter().find(|p| p.is_header(first)) {
                return Layout {
                    format: p.format,
                    header: true,
                };
            }
            match PRESETS.iter().find(|p| (p.looks_like)(first)) {
                Some(p) => Layout {
                    format: p.format,
                    header: false,
                },
                None => Layout {
                    format: InputFormat::Csv,
                    header: true,
                },
            }
        }
    }
}

/// `YYYY-MM-DD HH:MM:SS[.f]`, a switch's local time.
pub fn is_local_time(s: &str) -> bool {
    let s = s.trim();
    s.len() >= 19
        && s.as_bytes()[10] == b' '
        && NaiveDateTime::parse_from_str(s, "%Y-%m-%d %H:%M:%S%.f").is_ok()
}

fn is_integer(s: &str) -> bool {
    let s = s.trim();
    !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit())
}

/// A SIP request method (RFC 3261 and extensions: upper-case letters).
fn is_sip_method(s: &str) -> bool {
    matches!(
        s.trim(),
        "INVITE"
            | "ACK"
            | "BYE"
            | "CANCEL"
            | "REGISTER"
            | "OPTIONS"
            | "PRACK"
            | "SUBSCRIBE"
            | "NOTIFY"
            | "PUBLISH"
            | "INFO"
            | "REFER"
            | "MESSAGE"
            | "UPDATE"
    )
}

pub use crate::engine::event::seconds_to_ms;

#[cfg(test)]
mod tests {
    use super::*;

    fn cells(line: &str) -> Vec<&str> {
        line.split(',').collect()
    }

    #[test]
    fn detects_each_preset_from_a_row() {
        let std = ["call_id", "caller", "ts"];
        let asterisk = cells(
            r#","+34600000001,+34910000001,from-trunk,"" <+34600000001>,SIP/t-1,,Dial,,2025-12-01 10:00:00,2025-12-01 10:00:05,2025-12-01 10:01:00,60,55,ANSWERED,DOCUMENTATION,1764583200.1,"#,
        );
        assert_eq!(
            detect(InputFormat::Auto, &asterisk, &std),
            Layout {
                format: InputFormat::Asterisk,
                header: false
            }
        );
        let fs = cells(
            ",+34600000001,+34910000001,default,2025-12-01 10:00:00,,2025-12-01 10:00:30,30,0,NO_ANSWER,a1b2c3d4-0000-4000-8000-000000000001,,,PCMA,PCMA",
        );
        assert_eq!(
            detect(InputFormat::Auto, &fs, &std).format,
            InputFormat::FreeSwitch
        );
        let acc = cells("INVITE,ft1,tt1,abc@host,200,OK,2025-12-01 10:00:00,+34600000001,+34910000001,127.0.0.1");
        assert_eq!(
            detect(InputFormat::Auto, &acc, &std).format,
            InputFormat::KamailioAcc
        );
        let acc_epoch = cells("BYE,ft1,tt1,abc@host,200,OK,1764583200,+34600000001,+34910000001");
        assert_eq!(
            detect(InputFormat::Auto, &acc_epoch, &std).format,
            InputFormat::KamailioAcc
        );
    }

    #[test]
    fn headers_name_their_format() {
        let std = ["call_id", "caller", "ts"];
        let plain = cells("call_id,caller,ts,callee");
        assert_eq!(
            detect(InputFormat::Auto, &plain, &std),
            Layout {
                format: InputFormat::Csv,
                header: true
            }
        );
        let acc =
            cells("id,method,from_tag,to_tag,callid,sip_code,sip_reason,time,src_user,dst_user");
        assert_eq!(
            detect(InputFormat::Auto, &acc, &std),
            Layout {
                format: InputFormat::KamailioAcc,
                header: true
            }
        );
        // An explicit preset only asks whether the line is a header.
        assert!(detect(InputFormat::KamailioAcc, &acc, &std).header);
        let row = cells("INVITE,a,b,c,200,OK,2025-12-01 10:00:00,1,2");
        assert!(!detect(InputFormat::KamailioAcc, &row, &std).header);
        // Unknown shapes stay CSV (its reader names the missing column).
        let other = cells("a,b,c");
        assert_eq!(
            detect(InputFormat::Auto, &other, &std).format,
            InputFormat::Csv
        );
    }

    #[test]
    fn names_need_the_mapped_columns() {
        assert!(ASTERISK.names(17).is_none());
        let names = ASTERISK.names(19).unwrap();
        assert_eq!(names[16], "uniqueid");
        assert_eq!(names[18], "extra_18");
        assert_eq!(KAMAILIO_ACC.names(9).unwrap()[8], "dst_user");
    }

    #[test]
    fn seconds_become_milliseconds() {
        assert_eq!(seconds_to_ms("12"), Some(12_000));
        assert_eq!(seconds_to_ms(" 1764547200.25 "), Some(1_764_547_200_250));
        assert_eq!(seconds_to_ms("1.2345"), Some(1_234));
        assert_eq!(seconds_to_ms("-1"), None);
        assert_eq!(seconds_to_ms("1e3"), None);
        assert_eq!(seconds_to_ms(""), None);
    }
}
