//! `glmdiff run`: the reference and a candidate side by side over the same steps, and
//! `glmdiff compare`: the same table for two traces.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};

use super::{against_input, model_input, print_report, to_stdout, write_json, Outcome};
use crate::cli::{CompareArgs, ReportArgs, RunArgs};
use crate::compare::floors::{hook_infos, point_of};
use crate::compare::graph::{order_key, upstream};
use crate::compare::{Comparison, Judge, Precision};
use crate::driver::pair::{run_pair, Candidate, Modes};
use crate::driver::{prefix_values, Plan, Progress};
use crate::engine::cpu::CpuEngine;
use crate::engine::Engine;
use crate::explain::case::{self, CaseMeta};
use crate::explain::fault::{Fault, FaultEngine};
use crate::explain::{explain, Capture, Explanation};
use crate::gguf::Model;
use crate::model::Weights;
use crate::report::progress::Bar;
use crate::report::run::{render, to_json, EngineDesc, Header};
use crate::tokenizer::Tokenizer;
use crate::trace::cache::{CacheKey, Loaded, RefCache};
use crate::trace::{HookFilter, Mode, Pair, PairSink, TraceFile};
use crate::util::cache_dir::default_dir;
use crate::util::guard::Guard;

/// The candidate a run compares against.
enum Against {
    Cpu,
    /// The CUDA engine on device N.
    Cuda(usize),
    Trace(PathBuf),
}

/// Parses `--against`.
fn parse_against(s: &str) -> Result<Option<Against>> {
    match s {
        "auto" => Ok(None),
        "cpu" => Ok(Some(Against::Cpu)),
        c if c == "cuda" || c.starts_with("cuda:") => {
            if !cfg!(feature = "cuda") {
                bail!("run: --against {c}: this glmdiff was built without the `cuda` feature");
            }
            let n = match c.strip_prefix("cuda:") {
                None => 0,
                Some(n) => n.parse().with_context(|| {
                    format!("run: --against {c}: expected cuda or cuda:N with N a device index")
                })?,
            };
            Ok(Some(Against::Cuda(n)))
        }
        t if t.starts_with("trace:") => {
            let p = PathBuf::from(&t["trace:".len()..]);
            if p.as_os_str().is_empty() {
                bail!("run: --against trace: needs a file, e.g. --against trace:dump.safetensors");
            }
            Ok(Some(Against::Trace(p)))
        }
        other => bail!("run: --against {other:?}: expected auto, cpu, cuda[:N] or trace:FILE"),
    }
}

/// Traces beside `model` made for it (metadata `models` or `model` names its file), sorted.
fn traces_beside(model: &Path) -> Vec<(PathBuf, TraceFile)> {
    let Some(dir) = model.parent() else {
        return Vec::new();
    };
    let dir = if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    };
    let file = model
        .file_name()
        .map(|f| f.to_string_lossy().into_owned())
        .unwrap_or_default();
    let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.to_string_lossy().ends_with(".trace.safetensors"))
                .collect()
        })
        .unwrap_or_default();
    paths.sort();
    paths
        .into_iter()
        .filter_map(|p| {
            let t = TraceFile::open(&p).ok()?;
            let m = t.metadata();
            let listed: Vec<String> = m
                .get("models")
                .and_then(|v| serde_json::from_str(v).ok())
                .unwrap_or_else(|| m.get("model").cloned().into_iter().collect());
            listed.contains(&file).then_some((p, t))
        })
        .collect()
}

/// Prompt tokens from `--tokens` or `--prompt` (the tokenizer adds BOS when the model asks).
pub(crate) fn prompt_tokens(
    tokens: &Option<Vec<u32>>,
    prompt: &Option<String>,
    tokenizer: &Result<Tokenizer>,
    what: &str,
) -> Result<Option<Vec<u32>>> {
    Ok(match (tokens, prompt) {
        (Some(t), _) => Some(t.clone()),
        (None, Some(p)) => {
            let tok = tokenizer.as_ref().map_err(|e| anyhow::anyhow!("{e:#}")).with_context(|| {
                format!("{what}: --prompt needs the model's tokenizer; pass ids with --tokens instead")
            })?;
            let mut ids = Vec::new();
            if tok.add_bos() {
                ids.extend(tok.bos_id());
            }
            ids.extend(tok.encode(p)?);
            Some(ids)
        }
        (None, None) => None,
    })
}

/// How a token is shown: its decoded text quoted, or its vocabulary entry when it is a partial
/// UTF-8 sequence, or `?` without a tokenizer.
pub(crate) fn token_text(tok: Option<&Tokenizer>, id: u32) -> String {
    let Some(tok) = tok else {
        return "?".into();
    };
    match tok.decode(&[id]) {
        Ok(t) if !t.contains('\u{FFFD}') => format!("{t:?}"),
        _ => tok.token_text(id).map_or("?".into(), |v| format!("<{v}>")),
    }
}

/// Checks the outputs of `run` and `compare` against each other and the inputs `g` lists,
/// before any work.
fn check_outputs(mut g: Guard, report: &ReportArgs, repro: Option<&Path>) -> Result<()> {
    if let Some(p) = &report.plot {
        if p.extension().and_then(|e| e.to_str()) != Some("svg") {
            bail!("--plot {} must end in .svg", p.display());
        }
    }
    g.output_or_stdout("--json", report.json.as_deref())
        .output("--plot", report.plot.as_deref())
        .output_dir("--repro", repro)
        .check()
}

/// Prints the report, writes `--json` and `--plot`, and turns the verdict into the outcome.
fn finish(
    h: &Header,
    c: &Comparison,
    text: &dyn Fn(u32) -> String,
    report: &ReportArgs,
) -> Result<Outcome> {
    print_report(
        &render(h, c, text, report.all_steps),
        to_stdout(report.json.as_deref()),
    );
    write_outputs(h, c, &report.json, &report.plot)?;
    Ok(if c.differs() {
        Outcome::Differs
    } else {
        Outcome::Ok
    })
}

fn write_outputs(
    h: &Header,
    c: &Comparison,
    json: &Option<PathBuf>,
    plot: &Option<PathBuf>,
) -> Result<()> {
    if let Some(j) = json {
        write_json("--json", j, &to_json(h, c))?;
    }
    if let Some(p) = plot {
        crate::report::run::write_plot(h, c, p)?;
    }
    Ok(())
}

/// Runs `glmdiff run`.
pub fn run(args: &RunArgs) -> Result<Outcome> {
    let mut g = Guard::new();
    model_input(&mut g, "the input model", &args.model);
    against_input(&mut g, &args.against, &args.model);
    check_outputs(g, &args.report, args.repro.as_deref())?;
    let ran = execute(args)?;
    let tok = ran.tokenizer.as_ref();
    let text = |id: u32| token_text(tok, id);
    finish(&ran.header, &ran.comparison, &text, &args.report)
}

/// What one `run` computed: the facts for the header, the comparison, and the model's
/// tokenizer (when it has one) for showing tokens.
pub struct Ran {
    /// Facts about the run that the comparison does not hold.
    pub header: Header,
    /// Every hook's metrics and verdicts, and the output distributions.
    pub comparison: Comparison,
    /// The model's tokenizer.
    pub tokenizer: Option<Tokenizer>,
}

/// The start of the cache note when the reference cache could not be written (`regress` repeats
/// that note on stderr, having no run report to carry it).
pub(crate) const CACHE_NOT_WRITTEN: &str = "the reference cache was not written";

/// The work of `glmdiff run` without its outputs: opens the model, runs the reference and the
/// candidate over the asked steps and returns the comparison (`regress` runs its cases with it).
pub fn execute(args: &RunArgs) -> Result<Ran> {
    let mut against = parse_against(&args.against)?;
    if !args.devices.is_empty() {
        match against {
            None => against = Some(Against::Cuda(args.devices[0])),
            Some(Against::Cuda(n)) if args.against == "cuda" || n == args.devices[0] => {}
            _ => bail!(
                "run: --devices {:?} runs the CUDA engine: give --against cuda (or leave --against out), not --against {}",
                args.devices,
                args.against
            ),
        }
    }
    let modes = match args.mode.as_str() {
        "replay" => Modes {
            replay: true,
            chained: false,
        },
        "chained" => Modes {
            replay: false,
            chained: true,
        },
        _ => Modes::BOTH,
    };
    let faults: Vec<Fault> = args
        .inject
        .iter()
        .map(|s| Fault::parse(s))
        .collect::<Result<_>>()?;
    if (args.explain || args.repro.is_some()) && !modes.replay {
        bail!(
            "run: --explain and --repro work on the first step that fails in replay; use --mode replay or both"
        );
    }
    if let Some(dir) = &args.repro {
        crate::explain::case::check_target(dir)?;
    }
    let model = Model::open(&args.model)?;
    let weights = Weights::new(&model)?;
    let hp = weights.hparams();
    let tokenizer = Tokenizer::from_model(&model);
    let mut tokens = prompt_tokens(&args.tokens, &args.prompt, &tokenizer, "run")?;
    let mut notes = Vec::new();

    // The candidate.
    let (against, trace) = match against {
        Some(Against::Cpu) => (Against::Cpu, None),
        Some(Against::Cuda(n)) => (Against::Cuda(n), None),
        None if cuda_device_present() => {
            notes.push("--against auto: a CUDA device is present; comparing with the CUDA engine on device 0".to_string());
            (Against::Cuda(0), None)
        }
        Some(Against::Trace(p)) => {
            let t = TraceFile::open(&p)?;
            (Against::Trace(p), Some(t))
        }
        None => {
            let found = traces_beside(&args.model).into_iter().find(|(_, t)| {
                tokens
                    .as_ref()
                    .is_none_or(|want| t.tokens().ok().as_ref() == Some(want))
            });
            match found {
                Some((p, t)) => {
                    notes.push(format!(
                        "--against auto: no CUDA device; using the trace {} shipped beside the model",
                        p.display()
                    ));
                    (Against::Trace(p), Some(t))
                }
                None => bail!(
                    "run: --against auto: no CUDA device, and no trace beside {} made for this model{}; give --against cpu or --against trace:FILE",
                    args.model.display(),
                    if tokens.is_some() { " and these tokens" } else { "" }
                ),
            }
        }
    };
    // Missing CUDA libraries are said before any work, in the words of every GPU command.
    #[cfg(feature = "cuda")]
    if matches!(against, Against::Cuda(_)) {
        crate::gpu::probe_libraries()?;
    }
    if !faults.is_empty() && trace.is_some() {
        bail!(
            "run: --inject plants a bug in an engine glmdiff runs (--against cpu or cuda); a trace's bugs are its own"
        );
    }
    if let Some(t) = &trace {
        let tt = t.tokens()?;
        match &tokens {
            None => tokens = Some(tt),
            Some(mine) if *mine != tt => bail!(
                "run: the trace {} was made for tokens {:?}, not {:?}",
                t.path().display(),
                tt,
                mine
            ),
            _ => {}
        }
    }
    let tokens = tokens
        .context("run: give --tokens or --prompt (or a trace candidate, whose tokens are used)")?;
    crate::driver::check_tokens(&weights, &tokens).context("run")?;
    if let Some(t) = &trace {
        crate::trace::check::check_against_model(t, &weights, &tokens)?;
    }

    // Layers.
    let layers = match (args.layer, &args.layers) {
        (Some(n), _) => n..n + 1,
        (None, Some(r)) => r.clone(),
        (None, None) => 0..hp.n_layer as u64,
    };
    if layers.end > hp.n_layer as u64 {
        bail!(
            "run: layers {}..{} are out of range: the model runs layers 0..{} ({} blocks, {} MTP not run)",
            layers.start,
            layers.end,
            hp.n_layer,
            hp.n_block,
            hp.n_nextn
        );
    }
    let layers = layers.start as usize..layers.end as usize;
    let plan = Plan::range(&weights, layers.clone(), layers.end == hp.n_layer)?;
    for f in &faults {
        f.check(&weights, layers.clone(), plan.tail)?;
    }
    check_globs(
        "run",
        &format!("this run (layers {}..{})", layers.start, layers.end),
        &plan_hooks(&plan, hp),
        &args.report,
    )?;

    // The reference and the residual stream at the first layer.
    let reference = CpuEngine::new(&weights);
    let mut timings = Vec::new();
    let mut cache_note = None;
    let bar = Bar::new();
    let start = if plan.free_inputs().is_empty() {
        Vec::new()
    } else {
        let names = plan.free_inputs();
        let cache = if args.no_cache {
            None
        } else {
            let dir = match &args.cache_dir {
                Some(d) => d.clone(),
                None => default_dir()?,
            };
            Some((
                RefCache::new(&dir),
                CacheKey::new(&model, &tokens, layers.start)?,
            ))
        };
        let t0 = Instant::now();
        let mut damaged = None;
        let hit = match &cache {
            None => None,
            Some((c, k)) => match c.load(k, &names) {
                Loaded::Hit(v) => Some((v, c.path(k))),
                Loaded::Miss => None,
                Loaded::Damaged(why) => {
                    // Never compared against: recomputed and overwritten, and said at once.
                    crate::report::emit_err(&format!(
                        "note: the reference cache {} is damaged ({why}); layers 0..{} are recomputed and the entry rewritten",
                        c.path(k).display(),
                        layers.start
                    ));
                    damaged = Some(why);
                    None
                }
            },
        };
        match hit {
            Some((v, p)) => {
                timings.push((
                    "reference prefix (cache)".to_string(),
                    t0.elapsed().as_secs_f64(),
                ));
                cache_note = Some(format!(
                    "layers 0..{} of the reference read from the cache {}",
                    layers.start,
                    p.display()
                ));
                v
            }
            None => {
                let v = prefix_values(&reference, &weights, &tokens, &plan, &bar)?;
                timings.push((
                    format!("reference prefix (layers 0..{}, computed)", layers.start),
                    t0.elapsed().as_secs_f64(),
                ));
                if let Some((c, k)) = &cache {
                    match c.store(k, &v) {
                        Ok(p) => {
                            cache_note = Some(format!(
                                "layers 0..{} of the reference computed and cached in {}{}",
                                layers.start,
                                p.display(),
                                damaged.as_ref().map_or(String::new(), |why| format!(
                                    " (the entry there was damaged: {why})"
                                ))
                            ))
                        }
                        Err(e) => cache_note = Some(format!("{CACHE_NOT_WRITTEN}: {e:#}")),
                    }
                }
                v
            }
        }
    };

    if args.dtype != "f32" && !matches!(against, Against::Cuda(_)) {
        bail!(
            "run: --dtype {} sets the CUDA engine's precision; give --against cuda",
            args.dtype
        );
    }

    // Judge.
    let mut header_notes = Vec::new();
    let ref_prec = Precision::parse(&reference.dtype()).context("run: reference precision")?;
    let second_cpu = CpuEngine::new(&weights);
    let second = FaultEngine::new(&second_cpu, &weights, faults.clone());
    #[cfg(feature = "cuda")]
    let gpus: Vec<crate::gpu::Gpu> = match &against {
        Against::Cuda(n) => {
            let list = if args.devices.is_empty() {
                vec![*n]
            } else {
                args.devices.clone()
            };
            list.iter()
                .map(|&d| crate::gpu::Gpu::open(d))
                .collect::<Result<_>>()
                .context("run: --against cuda")?
        }
        _ => Vec::new(),
    };
    #[cfg(feature = "cuda")]
    let cuda_inner = if gpus.is_empty() {
        None
    } else {
        Some(crate::engine::cuda::multi::MultiCudaEngine::new(
            &gpus,
            &weights,
            crate::engine::cuda::GpuDtype::parse(&args.dtype)?,
        )?)
    };
    #[cfg(feature = "cuda")]
    let cuda_engine = cuda_inner
        .as_ref()
        .map(|e| FaultEngine::new(e, &weights, faults.clone()));
    let (cand_desc, cand_prec) = match (&against, &trace) {
        #[cfg(feature = "cuda")]
        (Against::Cuda(n), _) => {
            let e = cuda_engine.as_ref().context("run: the CUDA engine")?;
            let dtype = e.dtype();
            (
                EngineDesc {
                    spec: format!("cuda:{n}"),
                    describe: e.describe(),
                    dtype: dtype.clone(),
                },
                Precision::parse(&dtype).context("run: CUDA engine precision")?,
            )
        }
        (Against::Trace(p), Some(t)) => {
            let dtype = t.metadata().get("dtype").cloned().unwrap_or_default();
            let prec = match Precision::parse(&dtype) {
                Some(p) => p,
                None => {
                    notes.push(format!(
                        "the trace's dtype {dtype:?} is not a known precision; floors assume bf16"
                    ));
                    Precision::parse("bf16").context("bf16")?
                }
            };
            (
                EngineDesc {
                    spec: format!("trace:{}", p.display()),
                    describe: t
                        .metadata()
                        .get("engine")
                        .cloned()
                        .unwrap_or_else(|| "?".into()),
                    dtype,
                },
                prec,
            )
        }
        _ => (
            EngineDesc {
                spec: "cpu".into(),
                describe: second.describe(),
                dtype: second.dtype(),
            },
            ref_prec,
        ),
    };
    let judge = Judge {
        reference: ref_prec,
        candidate: cand_prec,
        infos: hook_infos(&plan.steps, &weights),
        tol: args.report.tol.clone(),
        precision: {
            let mut p = precision_overrides(&args.report.precision)?;
            if let Some(t) = &trace {
                p.extend(trace_precision(t, &mut header_notes));
                header_notes.extend(not_captured_note(t));
            }
            p
        },
        selection_bias: selection_bias(&weights, &plan)?,
        groups: hp.groups,
    };
    notes.append(&mut header_notes);
    if !faults.is_empty() {
        let f: Vec<String> = faults.iter().map(Fault::to_string).collect();
        notes.push(format!(
            "--inject {}: the candidate computes the steps these faults concern the faulty way (on the host, from its own inputs); every other step is the {} engine's",
            f.join(" "),
            cand_desc.spec
        ));
    }
    let mut cmp = Comparison::new(judge, wants_with_scores(&args.report.hook), &tokens);
    let t0 = Instant::now();
    let progress: &dyn Progress = &bar;
    let capture = args.explain || args.repro.is_some();
    // Without --explain/--repro the capture copies nothing and only passes pairs on.
    let mut capture_sink = Capture::new(&mut cmp, capture);
    let sink: &mut dyn PairSink = &mut capture_sink;
    let mut layer_times = Vec::new();
    #[cfg(feature = "cuda")]
    let on_gpu = if let Some(e) = &cuda_engine {
        layer_times = run_pair(
            &reference,
            Candidate::Engine(e),
            &weights,
            &tokens,
            &plan,
            &start,
            modes,
            sink,
            progress,
        )?
        .layer_times;
        if let (true, Some(m)) = (args.devices.len() > 1, &cuda_inner) {
            let (n, bytes) = m.handoffs();
            notes.push(format!(
                "{} devices, layers {:?}; {n} tensors ({:.1} MB) handed from GPU to GPU through the host",
                args.devices.len(),
                m.plan().ranges,
                bytes as f64 / 1e6
            ));
        }
        true
    } else {
        false
    };
    #[cfg(not(feature = "cuda"))]
    let on_gpu = false;
    if !on_gpu {
        let candidate: Candidate<'_, FaultEngine<'_, '_, CpuEngine<'_>>> = match &trace {
            Some(t) => Candidate::Trace(t),
            None => Candidate::Engine(&second),
        };
        layer_times = run_pair(
            &reference, candidate, &weights, &tokens, &plan, &start, modes, sink, progress,
        )?
        .layer_times;
    }
    let captured = capture_sink.captured();
    timings.push(("compared".to_string(), t0.elapsed().as_secs_f64()));
    if cmp.records().is_empty() {
        bail!(
            "run: no hook matched --hook {}; hook names are blk.L.<point>, token_embd, result_norm, logits",
            args.report.hook.join(" ")
        );
    }
    if let (Some(t), false) = (&trace, compared_any(&cmp)) {
        bail!(
            "run: no hook of the trace {} matches the run's {} hooks (its hooks are named as `glmdiff trace` names them: blk.L.<point>, token_embd, result_norm, logits); rename them with `glmdiff compare --map` or the hook script",
            t.path().display(),
            cmp.records().len()
        );
    }

    let t0 = Instant::now();
    let explanation = if args.explain {
        Some(match (cmp.first_divergence(Mode::Replay), &captured) {
            (None, _) => Explanation::NothingWrong,
            (Some(r), None) => Explanation::NotCaptured {
                note: format!(
                    "{} fails, but the inputs of its step were not at hand (a step replay could not run)",
                    r.name
                ),
            },
            (Some(_), Some(c)) => explain(c, &weights, &tokens, &Bar::with_unit("hypotheses"))?,
        })
    } else {
        None
    };
    if args.explain {
        timings.push(("explained".to_string(), t0.elapsed().as_secs_f64()));
    }
    let repro = match (&args.repro, &captured) {
        (Some(dir), Some(c)) => {
            let meta = CaseMeta {
                model: args.model.display().to_string(),
                tokens: tokens.clone(),
                candidate: cand_desc.spec.clone(),
                candidate_describe: cand_desc.describe.clone(),
                candidate_dtype: cand_desc.dtype.clone(),
                reference_dtype: reference.dtype(),
            };
            case::write(dir, c, &weights, &meta)?;
            Some(format!(
                "--repro: the step of {} written to {}; re-run it with: glmdiff step {} [--against cpu|cuda]",
                c.hook,
                dir.display(),
                shell_word(&dir.display().to_string())
            ))
        }
        (Some(_), None) => Some("--repro: no step fails in replay; no case written".to_string()),
        (None, _) => None,
    };

    let tok = tokenizer.as_ref().ok();
    let mut header = Header {
        command: "run".into(),
        model: args.model.display().to_string(),
        architecture: hp.arch.as_str().to_string(),
        layers: Some((layers.start, layers.end, hp.n_layer)),
        tokens: tokens.iter().map(|&id| (id, token_text(tok, id))).collect(),
        reference: EngineDesc {
            spec: "cpu".into(),
            describe: reference.describe(),
            dtype: reference.dtype(),
        },
        candidate: cand_desc,
        modes: [Mode::Replay, Mode::Chained]
            .into_iter()
            .filter(|m| match m {
                Mode::Replay => modes.replay,
                Mode::Chained => modes.chained,
            })
            .collect(),
        notes,
        cache: cache_note,
        rerun: None,
        timings,
        layer_times,
        explanation,
        repro,
    };
    let first = cmp
        .first_divergence(Mode::Replay)
        .or(cmp.first_divergence(Mode::Chained));
    if let Some(l) = first.and_then(|r| r.layer) {
        let ids: Vec<String> = tokens.iter().map(u32::to_string).collect();
        let injected: String = faults
            .iter()
            .filter(|f| f.layers.is_none() || f.at(Some(l)))
            .map(|f| format!(" --inject {}", shell_word(&f.to_string())))
            .collect();
        header.rerun = Some(format!(
            "glmdiff run {} --tokens {} --layer {l} --against {} --mode {}{}{injected}",
            shell_word(&args.model.display().to_string()),
            ids.join(","),
            shell_word(&header.candidate.spec),
            args.mode,
            args.report
                .hook
                .iter()
                .map(|g| format!(" --hook {}", shell_word(g)))
                .collect::<String>()
        ));
    }
    Ok(Ran {
        header,
        comparison: cmp,
        tokenizer: tokenizer.ok(),
    })
}

/// Whether any hook of `cmp` was compared in some mode (not only listed as missing).
fn compared_any(cmp: &Comparison) -> bool {
    cmp.records().iter().any(|r| {
        [&r.replay, &r.chained].iter().any(|m| {
            m.as_ref()
                .is_some_and(|m| m.status != crate::compare::Status::Missing)
        })
    })
}

/// Every hook `plan` can produce: its steps' outputs, and the optional attention probabilities
/// and per-expert outputs of its layers.
fn plan_hooks(plan: &Plan, hp: &crate::model::HParams) -> Vec<String> {
    use crate::model::steps::{expert_hook, hook, point};
    let mut v: Vec<String> = plan.steps.iter().flat_map(|s| s.outputs.clone()).collect();
    for l in plan.layers() {
        v.push(hook(l, point::ATTN_PROBS));
        if !hp.is_dense(l) {
            v.extend((0..hp.n_expert).map(|e| expert_hook(l, e)));
        }
    }
    v
}

/// Refuses a `--hook` glob that matches none of `hooks` (what the run or the reference trace
/// has), and a `--tol` or `--precision` glob that matches none of the hooks compared, naming
/// the flag, the glob and `scope`: a glob that silently matches nothing is a typo.
fn check_globs(cmd: &str, scope: &str, hooks: &[String], report: &ReportArgs) -> Result<()> {
    const NAMES: &str = "hook names are blk.L.<point>, token_embd, result_norm, logits";
    for g in &report.hook {
        if !hooks.iter().any(|h| crate::util::glob::matches(g, h)) {
            bail!("{cmd}: --hook {g:?} matches no hook of {scope}; {NAMES}");
        }
    }
    let wants = wants_with_scores(&report.hook);
    let compared: Vec<&String> = hooks.iter().filter(|h| wants(h)).collect();
    let flags = report
        .tol
        .iter()
        .map(|(g, _)| ("--tol", g))
        .chain(report.precision.iter().map(|(g, _)| ("--precision", g)));
    for (flag, g) in flags {
        if !compared.iter().any(|h| crate::util::glob::matches(g, h)) {
            bail!(
                "{cmd}: {flag} glob {g:?} matches none of the hooks compared in {scope}; {NAMES}"
            );
        }
    }
    Ok(())
}

/// Whether `--against auto` finds a CUDA device (driver, libraries and at least one device).
fn cuda_device_present() -> bool {
    #[cfg(feature = "cuda")]
    {
        crate::gpu::DeviceInfo::list().is_ok_and(|d| !d.is_empty())
    }
    #[cfg(not(feature = "cuda"))]
    {
        false
    }
}

/// `--precision` pairs as precisions.
fn precision_overrides(p: &[(String, String)]) -> Result<Vec<(String, Precision)>> {
    p.iter()
        .map(|(g, d)| {
            Precision::parse(d)
                .map(|p| (g.clone(), p))
                .with_context(|| format!("--precision {g}={d}: unknown dtype"))
        })
        .collect()
}

/// Precision overrides a trace declares: `indexer_dtype` (e.g. `fp8` for an FP8 DSA indexer)
/// sets the precision of `blk.*.indexer_*`. `--precision` flags come first and win.
fn trace_precision(t: &TraceFile, notes: &mut Vec<String>) -> Vec<(String, Precision)> {
    let Some(d) = t.metadata().get("indexer_dtype") else {
        return Vec::new();
    };
    match Precision::parse(d) {
        Some(p) => {
            notes.push(format!(
                "the trace's indexer_dtype {d:?} sets the candidate's precision of blk.*.indexer_*"
            ));
            vec![("blk.*.indexer_*".to_string(), p)]
        }
        None => {
            notes.push(format!(
                "the trace's indexer_dtype {d:?} is not a known precision; ignored"
            ));
            Vec::new()
        }
    }
}

/// A note listing what a trace's engine could not capture: metadata `not_captured`, a JSON object
/// from hook names or globs to the reason (a fused kernel with no hook point). Those hooks are
/// then reported as not in the trace.
fn not_captured_note(t: &TraceFile) -> Option<String> {
    let raw = t.metadata().get("not_captured")?;
    let Ok(map) = serde_json::from_str::<serde_json::Map<String, serde_json::Value>>(raw) else {
        return Some(format!(
            "the trace's metadata not_captured is not a JSON object of hooks to reasons: {raw:?}"
        ));
    };
    if map.is_empty() {
        return None;
    }
    let items: Vec<String> = map
        .iter()
        .map(|(h, why)| match why.as_str() {
            Some(w) if !w.is_empty() => format!("{h} ({w})"),
            _ => h.clone(),
        })
        .collect();
    Some(format!(
        "the trace's engine could not capture {} hook(s), shown as not in the trace: {}",
        map.len(),
        items.join("; ")
    ))
}

/// The hooks a comparison keeps: `--hook` globs (all standard hooks without them), plus the
/// score hooks behind a wanted selection (their values judge its flips).
fn wants_with_scores(globs: &[String]) -> Box<dyn Fn(&str) -> bool> {
    let filter = HookFilter {
        layers: None,
        globs: globs.to_vec(),
    };
    Box::new(move |n: &str| {
        filter.wants(n)
            || match crate::model::names::split_blk(n) {
                Some((l, "indexer_scores")) => filter.wants(&format!("blk.{l}.indexer_topk")),
                Some((l, "moe_probs")) => filter.wants(&format!("blk.{l}.moe_topk_ids")),
                _ => false,
            }
    })
}

/// The selection bias `exp_probs_b` of every MoE layer the plan runs.
fn selection_bias(weights: &Weights<'_>, plan: &Plan) -> Result<HashMap<usize, Vec<f32>>> {
    let mut out = HashMap::new();
    for l in plan.layers() {
        let name = crate::model::names::blk(l, crate::model::names::blk::EXP_PROBS_B);
        if weights.has(&name) {
            out.insert(l, weights.vector_desc(&name)?.dequantize()?);
        }
    }
    Ok(out)
}

/// Quotes a word for a POSIX shell when it needs it.
pub(crate) fn shell_word(s: &str) -> String {
    if !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./:=,@+".contains(c))
    {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', "'\\''"))
    }
}

/// Reads a `--map` file: a JSON object or a TOML table from the candidate's names to glmdiff's
/// (`.toml` is read as TOML, `.json` as JSON, anything else as whichever parses). Two names
/// mapped to one hook are refused.
fn read_map(path: &Path) -> Result<HashMap<String, String>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("compare: cannot read --map {}", path.display()))?;
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
    let json = || serde_json::from_str::<std::collections::BTreeMap<String, String>>(&text);
    let toml = || toml::from_str::<std::collections::BTreeMap<String, String>>(&text);
    let map = match ext {
        "json" => json().map_err(|e| anyhow::anyhow!("{e}")),
        "toml" => toml().map_err(|e| anyhow::anyhow!("{}", e.to_string().trim_end())),
        _ => json().or_else(|je| {
            toml().map_err(|te| {
                anyhow::anyhow!("as JSON: {je}; as TOML: {}", te.to_string().trim_end())
            })
        }),
    }
    .with_context(|| {
        format!(
            "compare: --map {} is not a {} of names to names (e.g. {})",
            path.display(),
            match ext {
                "json" => "JSON object",
                "toml" => "TOML table",
                _ => "JSON object or TOML table",
            },
            match ext {
                "toml" => r#""layers.0.self_attn.q_a_proj" = "blk.0.q_a""#,
                _ => r#"{"layers.0.self_attn.q_a_proj": "blk.0.q_a"}"#,
            }
        )
    })?;
    let mut seen: HashMap<&str, &str> = HashMap::new();
    for (from, to) in &map {
        if let Some(other) = seen.insert(to.as_str(), from.as_str()) {
            bail!(
                "compare: --map {}: {other:?} and {from:?} are both mapped to {to:?}",
                path.display()
            );
        }
    }
    Ok(map.into_iter().collect())
}

/// Runs `glmdiff compare`.
pub fn compare(args: &CompareArgs) -> Result<Outcome> {
    let mut g = Guard::new();
    g.input("the reference trace", &args.reference)
        .input("the candidate trace", &args.candidate);
    if let Some(m) = &args.map {
        g.input("the --map file", m);
    }
    check_outputs(g, &args.report, None)?;
    let reference = TraceFile::open(&args.reference)?;
    let candidate = TraceFile::open(&args.candidate)?;
    let (rt, ct) = (reference.tokens(), candidate.tokens());
    if let (Ok(a), Ok(b)) = (&rt, &ct) {
        if a != b {
            bail!(
                "compare: the traces were made for different tokens: {} has {:?}, {} has {:?}",
                args.reference.display(),
                a,
                args.candidate.display(),
                b
            );
        }
    }
    let tokens = rt.unwrap_or_default();
    // Candidate name -> glmdiff name.
    let map = match &args.map {
        Some(p) => read_map(p)?,
        None => HashMap::new(),
    };
    let cand_names: HashMap<String, String> = candidate
        .names()
        .map(|n| {
            (
                map.get(n).cloned().unwrap_or_else(|| n.to_string()),
                n.to_string(),
            )
        })
        .collect();
    let prec = |t: &TraceFile, which: &str, notes: &mut Vec<String>| -> Result<Precision> {
        let d = t.metadata().get("dtype").cloned().unwrap_or_default();
        Ok(match Precision::parse(&d) {
            Some(p) => p,
            None => {
                notes.push(format!(
                    "the {which}'s dtype {d:?} is not a known precision; floors assume bf16"
                ));
                Precision::parse("bf16").context("bf16")?
            }
        })
    };
    let mut notes = Vec::new();
    let judge = Judge {
        reference: prec(&reference, "reference", &mut notes)?,
        candidate: prec(&candidate, "candidate", &mut notes)?,
        infos: HashMap::new(),
        tol: args.report.tol.clone(),
        precision: {
            let mut p = precision_overrides(&args.report.precision)?;
            p.extend(trace_precision(&candidate, &mut notes));
            notes.extend(not_captured_note(&candidate));
            p
        },
        selection_bias: HashMap::new(),
        groups: None,
    };
    let mut names: Vec<String> = reference.names().map(str::to_string).collect();
    names.sort_by_key(|n| order_key(n));
    check_globs(
        "compare",
        &format!("the reference trace {}", args.reference.display()),
        &names,
        &args.report,
    )?;
    let wanted = wants_with_scores(&args.report.hook);
    let pairs: Vec<(String, String)> = names
        .iter()
        .filter(|n| wanted(n))
        .filter_map(|n| cand_names.get(n).map(|c| (n.clone(), c.clone())))
        .collect();
    if pairs.is_empty() {
        bail!(
            "compare: no hook of {} matches {} ({} of its hooks compared, none under those names in the candidate); rename the candidate's hooks with --map FILE (a JSON object or TOML table of their names to glmdiff's)",
            args.candidate.display(),
            args.reference.display(),
            names.iter().filter(|n| wanted(n)).count()
        );
    }
    crate::trace::check::check_pair(&reference, &candidate, &pairs)?;
    let last_l_out = names
        .iter()
        .rev()
        .find(|n| point_of(n) == "l_out")
        .cloned()
        .unwrap_or_default();
    let present = |n: &str| reference.has(n);
    let mut cmp = Comparison::new(judge, wants_with_scores(&args.report.hook), &tokens);
    let bar = Bar::with_unit("hooks");
    bar.start("compare", names.len() as u64);
    for n in &names {
        bar.inc(1);
        if !cmp.wants(n) {
            continue;
        }
        let inputs = upstream(n, &present, &last_l_out);
        let r = reference.get(n)?.context("compare: hook vanished")?;
        match cand_names.get(n) {
            None => cmp.missing(n, Mode::Chained, "not in the candidate trace"),
            Some(cn) => {
                let c = candidate.get(cn)?.context("compare: hook vanished")?;
                cmp.record(Pair {
                    name: n,
                    mode: Mode::Chained,
                    inputs: &inputs,
                    reference: r,
                    candidate: c,
                    note: None,
                })?;
            }
        }
    }
    bar.finish();
    if cmp.records().is_empty() {
        bail!("compare: no hook of {} matched", args.reference.display());
    }
    let desc = |p: &Path, t: &TraceFile| EngineDesc {
        spec: p.display().to_string(),
        describe: t
            .metadata()
            .get("engine")
            .cloned()
            .unwrap_or_else(|| "?".into()),
        dtype: t.metadata().get("dtype").cloned().unwrap_or_default(),
    };
    let header = Header {
        command: "compare".into(),
        model: reference
            .metadata()
            .get("model")
            .cloned()
            .unwrap_or_else(|| args.reference.display().to_string()),
        architecture: reference
            .metadata()
            .get("architecture")
            .cloned()
            .unwrap_or_else(|| "?".into()),
        layers: None,
        tokens: tokens.iter().map(|&id| (id, String::new())).collect(),
        reference: desc(&args.reference, &reference),
        candidate: desc(&args.candidate, &candidate),
        modes: vec![Mode::Chained],
        notes,
        cache: None,
        rerun: None,
        timings: Vec::new(),
        layer_times: Vec::new(),
        explanation: None,
        repro: None,
    };
    let text = |id: u32| id.to_string();
    finish(&header, &cmp, &text, &args.report)
}
