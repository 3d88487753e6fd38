//! Every name that comes from outside, checked in one place before it becomes a subject token,
//! a key, a directory or a line on someone's terminal.
//!
//! | name | characters | length |
//! | --- | --- | --- |
//! | node, principal, allocation path segment | ASCII letters, digits, `-`, `_`; first a letter or digit | node 1–128, principal 1–64, segment 1–64 |
//! | allocation path | segments joined by `/` | at most 8 levels, 255 bytes |
//! | node label key | ASCII letters, digits, `-`, `_`, `.`, `/`; first a letter or digit | 1–128 |
//! | node label value, GPU model | printable ASCII (space to `~`) | model 1–64, value 0–128 |
//! | workload name, why a node was drained | any text without control or invisible characters (bidirectional overrides, zero-width) | name 0–256 bytes, reason 0–256 |
//! | environment variable name | ASCII letters, digits, `_`; first not a digit | 1–256 |
//! | environment value, command argument | any text without NUL | 32 KiB each, 256 arguments, 256 variables |
//!
//! A name of the first kind is its own subject token (NATS tokens may not hold `.`, `*`, `>` or
//! white space), so two different names never share a subject, and the longest subject the
//! ledger writes stays far under the 1,024 bytes NATS and the embedded log allow. The leading
//! letter or digit keeps names clear of the tokens the ledger keeps for itself
//! (`_unallocated`) and of options on a command line (`-x`).

use std::collections::BTreeMap;

use crate::Rejection;

/// The longest node name.
pub const NODE_MAX: usize = 128;
/// The longest principal name.
pub const PRINCIPAL_MAX: usize = 64;
/// The longest allocation path segment.
pub const SEGMENT_MAX: usize = 64;
/// The longest allocation path.
pub const PATH_MAX: usize = 255;
/// The deepest allocation path.
pub const PATH_DEPTH_MAX: usize = 8;
/// The longest workload name.
pub const WORKLOAD_NAME_MAX: usize = 256;
/// The most command arguments and the most environment variables.
pub const ARGS_MAX: usize = 256;
/// The longest command argument or environment value.
pub const ARG_MAX: usize = 32 * 1024;
/// The longest reason for draining a node.
pub const REASON_MAX: usize = 256;
/// The most labels on a node.
pub const LABELS_MAX: usize = 32;

/// A token: `max` bytes at most of ASCII letters, digits, `-` and `_`, the first a letter or
/// digit; `what` names it in the reason.
fn token(s: &str, max: usize, what: &str) -> Result<(), String> {
    if s.is_empty() || s.len() > max {
        return Err(format!("{what} has 1 to {max} characters"));
    }
    if !s.starts_with(|c: char| c.is_ascii_alphanumeric()) {
        return Err(format!("{what} starts with a letter or digit"));
    }
    if let Some(c) = s
        .chars()
        .find(|&c| !(c.is_ascii_alphanumeric() || c == '-' || c == '_'))
    {
        return Err(format!(
            "{what} holds only letters, digits, '-' and '_', not {}",
            shown(c)
        ));
    }
    Ok(())
}

/// `c` as a reason shows it: printable characters quoted, others by their code.
fn shown(c: char) -> String {
    if c.is_ascii_graphic() {
        format!("'{c}'")
    } else {
        format!("U+{:04X}", c as u32)
    }
}

/// Checks a node's name (a subject token, a key and a directory name).
pub fn node(name: &str) -> Result<(), String> {
    token(name, NODE_MAX, "a node name")
}

/// The longest Unix user name accepted.
pub const UNIX_USER_MAX: usize = 32;

/// Checks a Unix user's name as a grant names it: a portable one (a lower-case letter or `_`,
/// then lower-case letters, digits, `_` or `-`, at most [`UNIX_USER_MAX`]), and not root.
pub fn unix_user(name: &str) -> Result<(), String> {
    let mut chars = name.chars();
    let first_ok = chars
        .next()
        .is_some_and(|c| c.is_ascii_lowercase() || c == '_');
    let rest_ok =
        chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == '-');
    if !first_ok || !rest_ok || name.len() > UNIX_USER_MAX {
        return Err(format!(
            "{name:?} is not a Unix user name: a lower-case letter or _, then lower-case letters, digits, _ or -, at most {UNIX_USER_MAX}"
        ));
    }
    if name == "root" {
        return Err("a workload never runs as root".into());
    }
    Ok(())
}

/// Checks a principal's name (a subject token and an actor).
pub fn principal(name: &str) -> Result<(), String> {
    token(name, PRINCIPAL_MAX, "a name")
}

/// Checks an allocation path: segments joined by `/`, each a token, at most
/// [`PATH_DEPTH_MAX`] levels and [`PATH_MAX`] bytes.
pub fn path(path: &str) -> Result<(), Rejection> {
    let bad = |reason: String| {
        Err(Rejection::InvalidAllocationPath {
            path: path.to_string(),
            reason,
        })
    };
    if path.is_empty() {
        return bad("it is empty".into());
    }
    if path.len() > PATH_MAX {
        return bad(format!("it is longer than {PATH_MAX} bytes"));
    }
    let mut depth = 0;
    for seg in path.split('/') {
        depth += 1;
        if seg.is_empty() {
            return bad("it has an empty segment (leading, trailing or double '/')".into());
        }
        if let Err(reason) = token(seg, SEGMENT_MAX, "a segment") {
            return bad(reason);
        }
    }
    if depth > PATH_DEPTH_MAX {
        return bad(format!("it is deeper than {PATH_DEPTH_MAX} levels"));
    }
    Ok(())
}

/// Checks the path of an allocation being created by an event of `schema_version`: version 1
/// events were held only to segments of letters, digits, `-` and `_` (at most 8 levels and
/// 255 bytes), and are folded so still.
pub(crate) fn path_as_of(schema_version: u16, p: &str) -> Result<(), Rejection> {
    if schema_version >= 2 {
        return path(p);
    }
    let segments_ok = !p.is_empty()
        && p.len() <= PATH_MAX
        && p.split('/').count() <= PATH_DEPTH_MAX
        && p.split('/').all(|seg| {
            !seg.is_empty()
                && seg
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        });
    if segments_ok {
        Ok(())
    } else {
        path(p)
    }
}

/// Printable ASCII, `min..=max` bytes.
fn printable(s: &str, min: usize, max: usize, what: &str) -> Result<(), String> {
    if s.len() < min || s.len() > max {
        return Err(format!("{what} has {min} to {max} characters"));
    }
    if let Some(c) = s.chars().find(|&c| !(c == ' ' || c.is_ascii_graphic())) {
        return Err(format!(
            "{what} holds only printable ASCII, not {}",
            shown(c)
        ));
    }
    Ok(())
}

/// Checks a GPU model's name.
pub fn model(model: &str) -> Result<(), Rejection> {
    printable(model, 1, 64, "a GPU model").map_err(|reason| invalid("model", reason))
}

/// Checks a node's labels.
pub fn labels(labels: &BTreeMap<String, String>) -> Result<(), Rejection> {
    if labels.len() > LABELS_MAX {
        return Err(invalid("labels", format!("at most {LABELS_MAX} labels")));
    }
    for (k, v) in labels {
        let key_ok = !k.is_empty()
            && k.len() <= 128
            && k.starts_with(|c: char| c.is_ascii_alphanumeric())
            && k.chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_./".contains(c));
        if !key_ok {
            return Err(invalid(
                "labels",
                format!(
                    "label {:?}: a key has 1 to 128 letters, digits, '-', '_', '.' or '/', the first a letter or digit",
                    k.escape_debug().to_string()
                ),
            ));
        }
        printable(v, 0, 128, "a label value")
            .map_err(|reason| invalid("labels", format!("label {k}: {reason}")))?;
    }
    Ok(())
}

/// Checks what a submission asks a node to run: its name, command and environment. The
/// environment's names are what POSIX shells accept, so a node can always set them.
pub fn workload(
    name: Option<&str>,
    command: &[String],
    env: &BTreeMap<String, String>,
) -> Result<(), Rejection> {
    if let Some(name) = name {
        note("name", name, WORKLOAD_NAME_MAX)?;
    }
    if command.len() > ARGS_MAX {
        return Err(invalid("command", format!("at most {ARGS_MAX} arguments")));
    }
    for (i, arg) in command.iter().enumerate() {
        if arg.len() > ARG_MAX || arg.contains('\0') {
            return Err(invalid(
                "command",
                format!("argument {i}: at most {ARG_MAX} bytes and no NUL character"),
            ));
        }
    }
    if command.first().is_some_and(String::is_empty) {
        return Err(invalid("command", "the program (argument 0) is empty"));
    }
    if env.len() > ARGS_MAX {
        return Err(invalid("env", format!("at most {ARGS_MAX} variables")));
    }
    for (k, v) in env {
        let key_ok = !k.is_empty()
            && k.len() <= 256
            && !k.starts_with(|c: char| c.is_ascii_digit())
            && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !key_ok {
            return Err(invalid(
                "env",
                format!(
                    "variable {:?}: a name has 1 to 256 letters, digits and '_', not starting with a digit",
                    k.escape_debug().to_string()
                ),
            ));
        }
        if v.len() > ARG_MAX || v.contains('\0') {
            return Err(invalid(
                "env",
                format!("variable {k}: at most {ARG_MAX} bytes and no NUL character"),
            ));
        }
    }
    Ok(())
}

/// Checks free text shown to people (a workload's name, why a node was drained): at most `max`
/// bytes, without control characters or the invisible ones that change how text around them
/// shows (see [`terminal_safe`]).
pub fn note(field: &'static str, text: &str, max: usize) -> Result<(), Rejection> {
    if text.len() > max {
        return Err(invalid(field, format!("at most {max} bytes")));
    }
    if let Some(c) = text.chars().find(|&c| c.is_control() || invisible(c)) {
        return Err(invalid(
            field,
            format!("no control or invisible characters, not {}", shown(c)),
        ));
    }
    Ok(())
}

/// Characters that change how the text around them shows without showing themselves:
/// bidirectional marks, embeddings, overrides and isolates (which can make a terminal show
/// text in another order), zero-width characters, the byte-order mark and the soft hyphen.
fn invisible(c: char) -> bool {
    matches!(
        c,
        '\u{00AD}'
            | '\u{061C}'
            | '\u{200B}'..='\u{200F}'
            | '\u{202A}'..='\u{202E}'
            | '\u{2060}'..='\u{2064}'
            | '\u{2066}'..='\u{2069}'
            | '\u{FEFF}'
    )
}

fn invalid(field: &'static str, reason: impl Into<String>) -> Rejection {
    Rejection::InvalidField {
        field,
        reason: reason.into(),
    }
}

/// `s` safe to print on a terminal: control characters (escape sequences, carriage returns,
/// NUL) and invisible ones (bidirectional overrides, zero-width characters) shown escaped,
/// everything else as it is.
pub fn terminal_safe(s: &str) -> std::borrow::Cow<'_, str> {
    let unsafe_char = |c: char| c.is_control() || invisible(c);
    if !s.chars().any(unsafe_char) {
        return s.into();
    }
    s.chars()
        .map(|c| {
            if unsafe_char(c) {
                c.escape_unicode().to_string()
            } else {
                c.to_string()
            }
        })
        .collect::<String>()
        .into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_refuse_what_would_share_a_subject_or_reach_a_terminal() {
        for bad in [
            "",
            "a.b",
            "a b",
            "a\nb",
            "a\tb",
            "a\0b",
            "a\x1bb",
            "_unallocated",
            "-x",
            "a*",
            "a>",
            "é",
        ] {
            assert!(node(bad).is_err(), "{bad:?}");
            assert!(principal(bad).is_err(), "{bad:?}");
            assert!(path(bad).is_err(), "{bad:?}");
        }
        assert!(node(&"n".repeat(NODE_MAX)).is_ok());
        assert!(node(&"n".repeat(NODE_MAX + 1)).is_err());
        assert!(path("ai2/olmo-3/pre_train").is_ok());
        let deep = format!("{}a", "a/".repeat(PATH_DEPTH_MAX));
        for bad in [
            "/a",
            "a/",
            "a//b",
            "a/_b",
            &deep,
            &"a".repeat(SEGMENT_MAX + 1),
        ] {
            assert!(path(bad).is_err(), "{bad:?}");
        }
        let reason = node("a\x1bb").unwrap_err();
        assert!(reason.contains("U+001B"), "{reason}");
    }

    #[test]
    fn a_workload_runs_what_a_node_can_launch() {
        let env = |k: &str, v: &str| BTreeMap::from([(k.to_owned(), v.to_owned())]);
        let none = BTreeMap::new();
        assert!(workload(
            Some("train"),
            &["python".into(), "x.py".into()],
            &env("A_1", "v")
        )
        .is_ok());
        let field = |r: Result<(), Rejection>| match r {
            Err(Rejection::InvalidField { field, .. }) => field,
            other => panic!("{other:?}"),
        };
        assert_eq!(field(workload(None, &["a\0b".into()], &none)), "command");
        assert_eq!(field(workload(None, &["".into()], &none)), "command");
        for key in ["A\0", "A=B", "", "1A", "A B"] {
            assert_eq!(field(workload(None, &[], &env(key, "v"))), "env", "{key:?}");
        }
        assert_eq!(field(workload(None, &[], &env("A", "x\0"))), "env");
        assert_eq!(field(workload(Some("a\x1b[2J"), &[], &none)), "name");
        // A right-to-left override would show the name in another order.
        assert_eq!(
            field(workload(Some("train\u{202E}gpj.sh"), &[], &none)),
            "name"
        );
        assert!(workload(Some("entraînement 训练"), &[], &none).is_ok());
    }

    #[test]
    fn terminal_output_escapes_control_characters() {
        assert_eq!(terminal_safe("demo-0"), "demo-0");
        assert_eq!(terminal_safe("a\x1b[2Jb\n"), "a\\u{1b}[2Jb\\u{a}");
        assert_eq!(terminal_safe("a\u{202E}b\u{200B}"), "a\\u{202e}b\\u{200b}");
        assert_eq!(terminal_safe("训练"), "训练");
    }
}
