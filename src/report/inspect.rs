//! Text rendering of `glmdiff inspect`: formats an [`InspectReport`] built by
//! [`crate::model::inspect`].

use std::fmt::Write as _;

use super::{human_bytes, layout, table};

/// With a width, metadata values are cut to this many characters (`--json` has them whole).
const VALUE_MAX: usize = 240;
use crate::model::inspect::InspectReport;

/// Renders the report as text.
pub fn render(r: &InspectReport) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "model:        {}", r.files.join(", "));
    let _ = writeln!(s, "gguf version: {}", r.gguf_version);
    let _ = writeln!(s, "architecture: {}", r.architecture);
    if let Some(n) = &r.name {
        let _ = writeln!(s, "name:         {n}");
    }
    let _ = writeln!(
        s,
        "tensors:      {} ({} in {} file{})",
        r.tensor_count,
        human_bytes(r.total_bytes),
        r.files.len(),
        if r.files.len() == 1 { "" } else { "s" }
    );
    let t = &r.tokenizer;
    let special: Vec<String> = t.special.iter().map(|(k, v)| format!("{k}={v}")).collect();
    let _ = writeln!(
        s,
        "tokenizer:    model={} pre={} tokens={} merges={}{}{}",
        t.model.as_deref().unwrap_or("-"),
        t.pre.as_deref().unwrap_or("-"),
        t.tokens,
        t.merges,
        if special.is_empty() {
            String::new()
        } else {
            format!(" {}", special.join(" "))
        },
        if t.chat_template {
            " chat_template"
        } else {
            ""
        }
    );

    if !r.hyperparameters.is_empty() {
        let _ = writeln!(s, "\nhyperparameters ({}.*):", r.architecture);
        let mut h = table(&["key", "value"]);
        for (k, v) in &r.hyperparameters {
            h.add_row(vec![k.clone(), short_json(v)]);
        }
        let _ = writeln!(s, "{h}");
    }
    match &r.forward_pass {
        None => {}
        Some(Ok(fp)) => {
            let _ = writeln!(s, "\nforward pass (as glmdiff runs it, defaults applied):");
            let mut h = table(&["what", "value"]);
            for (k, v) in fp {
                h.add_row(vec![k.clone(), v.clone()]);
            }
            let _ = writeln!(s, "{h}");
        }
        Some(Err(e)) => {
            let _ = writeln!(s, "\nforward pass: cannot run: {e}");
        }
    }
    if !r.other_metadata.is_empty() {
        let _ = writeln!(s, "\nother metadata:");
        let mut h = table(&["key", "value"]);
        for (k, v) in &r.other_metadata {
            let v = match layout::width() {
                Some(_) => layout::shorten(v, VALUE_MAX),
                None => v.clone(),
            };
            h.add_row(vec![k.clone(), v]);
        }
        let _ = writeln!(s, "{h}");
    }

    let _ = writeln!(s, "\ntypes:");
    let mut h = table(&["type", "tensors", "elements", "bytes", "share"]);
    for row in &r.types {
        h.add_row(vec![
            row.ty.clone(),
            row.tensors.to_string(),
            row.elements.to_string(),
            human_bytes(row.bytes),
            format!(
                "{:.1}%",
                100.0 * row.bytes as f64 / r.total_bytes.max(1) as f64
            ),
        ]);
    }
    let _ = writeln!(s, "{h}");

    let _ = writeln!(
        s,
        "\ntensors ({} of {} shown):",
        r.tensors.len(),
        r.tensor_count
    );
    let mut h = table(&["name", "type", "shape", "bytes", "shard"]);
    for t in &r.tensors {
        h.add_row(vec![
            t.name.clone(),
            t.ty.clone(),
            format!("{:?}", t.shape),
            human_bytes(t.bytes),
            t.shard.to_string(),
        ]);
    }
    let _ = writeln!(s, "{h}");
    s
}

/// Prints the report to stdout.
pub fn print(r: &InspectReport) {
    super::emit(&render(r));
}

/// A JSON value on one line, long arrays cut.
fn short_json(v: &serde_json::Value) -> String {
    match v {
        serde_json::Value::Array(a) if a.len() > 8 => {
            let head: Vec<String> = a.iter().take(8).map(|x| x.to_string()).collect();
            format!("[{}, ... ({} items)]", head.join(", "), a.len())
        }
        serde_json::Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}
