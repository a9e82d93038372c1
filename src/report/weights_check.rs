//! Text and JSON of `glmdiff weights-check` (the JSON document: docs/weights-check-json.md).

use std::fmt::Write as _;

use serde_json::{json, Value};

use super::{table, Grid};
use crate::wcheck::{Report, Status, TensorResult};

/// Above this many tensors the table keeps failing tensors and one summary row per layer.
const FULL_TABLE_MAX: usize = 150;

/// Version of the JSON document.
pub const JSON_VERSION: u32 = 1;

fn sci(v: Option<f64>) -> String {
    v.map_or("-".into(), |x| format!("{x:.3e}"))
}

fn verdict(t: &TensorResult) -> String {
    match t.status {
        Status::Pass => match (t.acc.nmse(), t.expected_nmse) {
            (Some(n), Some(e)) if e > 0.0 => format!("ok ({:.2}x expected)", n / e),
            _ => "ok".into(),
        },
        Status::Skipped => format!("skipped: {}", t.note.as_deref().unwrap_or("")),
        Status::Fail | Status::ShapeMismatch => {
            let head = if t.status == Status::Fail {
                if t.acc.nonfinite_gguf > 0 {
                    format!("FAIL ({} NaN/Inf)", t.acc.nonfinite_gguf)
                } else {
                    "FAIL".to_string()
                }
            } else {
                "FAIL (shape)".to_string()
            };
            match &t.diagnosis {
                Some(d) => format!("{head}: {}", d.summary),
                None => format!("{head}: {}", t.note.as_deref().unwrap_or("")),
            }
        }
    }
}

fn row(t: &TensorResult) -> Vec<String> {
    let compared = t.acc.n > 0;
    vec![
        t.name.clone(),
        t.ty.clone(),
        format!("{:?}", t.shape),
        if t.source_dtype.is_empty() {
            t.source.clone()
        } else {
            format!("{} [{}]", t.source, t.source_dtype)
        },
        if compared {
            sci(t.acc.nmse())
        } else {
            "-".into()
        },
        if compared {
            sci(t.expected_nmse)
        } else {
            "-".into()
        },
        if compared {
            format!(
                "{:.3e} @{:?}",
                t.acc.max_abs,
                t.max_at.clone().unwrap_or_default()
            )
        } else {
            "-".into()
        },
        if compared {
            t.acc.cosine().map_or("-".into(), |c| format!("{c:.6}"))
        } else {
            "-".into()
        },
        verdict(t),
    ]
}

/// Renders the report as text.
pub fn render(r: &Report) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "gguf:      {}", r.gguf);
    let _ = writeln!(s, "reference: {}", r.reference);
    if let Some(d) = &r.dims {
        let _ = writeln!(
            s,
            "kv_b:      {} heads x (nope {} + v {}) rows, kv_lora {}",
            d.n_head, d.nope, d.v, d.kv_lora
        );
    }
    // Narrow: the tensor, its type, NMSE against the expected and the verdict stay.
    let mut t = Grid::new(&[
        ("tensor", 0),
        ("type", 0),
        ("shape", 4),
        ("reference [dtype]", 3),
        ("NMSE", 0),
        ("expected", 2),
        ("max |diff| @", 5),
        ("cosine", 6),
        ("verdict", 0),
    ])
    .whole(&[0]);
    if r.tensors.len() <= FULL_TABLE_MAX {
        for x in &r.tensors {
            t.add_row(row(x));
        }
    } else {
        // Failing tensors in full; passing ones summarized per layer.
        let mut groups: Vec<(String, Vec<&TensorResult>)> = Vec::new();
        for x in &r.tensors {
            let g = crate::model::names::split_blk(&x.name)
                .map_or("global".to_string(), |(l, _)| format!("blk.{l}"));
            match groups.last_mut() {
                Some((k, v)) if *k == g => v.push(x),
                _ => groups.push((g, vec![x])),
            }
        }
        for (g, v) in groups {
            let ok: Vec<&&TensorResult> = v.iter().filter(|x| x.status == Status::Pass).collect();
            let worst = ok
                .iter()
                .filter_map(|x| Some((x.acc.nmse()? / x.expected_nmse.filter(|&e| e > 0.0)?, x)))
                .max_by(|a, b| a.0.total_cmp(&b.0));
            t.add_row(vec![
                format!("{g} ({} tensors)", v.len()),
                String::new(),
                String::new(),
                String::new(),
                String::new(),
                String::new(),
                String::new(),
                String::new(),
                match worst {
                    Some((w, x)) => format!("{} ok, worst {w:.2}x expected ({})", ok.len(), x.name),
                    None => format!("{} ok", ok.len()),
                },
            ]);
            for x in v.iter().filter(|x| x.status != Status::Pass) {
                t.add_row(row(x));
            }
        }
    }
    let _ = writeln!(s, "{t}");
    for (title, list) in [
        ("GGUF tensors with no reference", &r.gguf_only),
        (
            "reference tensors with no GGUF counterpart",
            &r.reference_only,
        ),
    ] {
        if list.is_empty() {
            continue;
        }
        let _ = writeln!(s, "{title}:");
        let mut u = table(&["tensor", "shape", "note"]);
        for x in list.iter() {
            u.add_row(vec![
                x.name.clone(),
                format!("{:?}", x.shape),
                if x.expected {
                    format!("(expected) {}", x.note)
                } else {
                    x.note.clone()
                },
            ]);
        }
        let _ = writeln!(s, "{u}");
    }
    for n in &r.notes {
        let _ = writeln!(s, "note: {n}");
    }
    let count = |st: Status| r.tensors.iter().filter(|t| t.status == st).count();
    let _ = writeln!(
        s,
        "{} tensors, {} values compared: {} ok, {} fail, {} shape mismatch, {} skipped; {} GGUF-only, {} reference-only ({} expected)",
        r.tensors.len(),
        r.values,
        count(Status::Pass),
        count(Status::Fail),
        count(Status::ShapeMismatch),
        count(Status::Skipped),
        r.gguf_only.len(),
        r.reference_only.len(),
        r.reference_only.iter().filter(|u| u.expected).count()
    );
    let _ = writeln!(
        s,
        "A tensor passes when its squared error is at most {}x what its type's rounding explains (expected NMSE, from its block scales).",
        r.allowed_factor
    );
    if r.differs() {
        let _ = writeln!(s, "DIFFERS: see the FAIL rows and unmatched tensors above");
    } else {
        let _ = writeln!(
            s,
            "OK: every tensor matches its reference within its rounding"
        );
    }
    s
}

/// The JSON document.
pub fn to_json(r: &Report) -> Value {
    let tensors: Vec<Value> = r
        .tensors
        .iter()
        .map(|t| {
            json!({
                "name": t.name,
                "type": t.ty,
                "shape": t.shape,
                "reference": t.source,
                "reference_dtype": t.source_dtype,
                "status": t.status,
                "values": t.acc.n,
                "nmse": t.acc.nmse().filter(|x| x.is_finite()),
                "expected_nmse": t.expected_nmse.filter(|x| x.is_finite()),
                "allowed_nmse": t.allowed_nmse.filter(|x| x.is_finite()),
                "max_abs_diff": t.acc.max_abs,
                "max_abs_diff_at": t.max_at,
                "cosine": t.acc.cosine().filter(|x| x.is_finite()),
                "nonfinite": [t.acc.nonfinite_gguf, t.acc.nonfinite_ref],
                "diagnosis": t.diagnosis,
                "note": t.note,
            })
        })
        .collect();
    json!({
        "glmdiff_weights_check": JSON_VERSION,
        "glmdiff_version": env!("CARGO_PKG_VERSION"),
        "gguf": r.gguf,
        "reference": r.reference,
        "reference_kind": r.reference_kind,
        "dims": r.dims,
        "allowed_factor": r.allowed_factor,
        "verdict": if r.differs() { "differs" } else { "ok" },
        "values": r.values,
        "tensors": tensors,
        "gguf_only": r.gguf_only,
        "reference_only": r.reference_only,
        "notes": r.notes,
    })
}
