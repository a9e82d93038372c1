//! A run's choices (`--against`, `--mode`, `--dtype`), the plain values it is asked with
//! ([`RunRequest`]: `cmd` maps `run`'s flags to them, `regress` its cases) and the checked
//! [`RunConfig`] that [`RunConfig::check`] builds from them, every check done before any work:
//! the model opened and its hyperparameters read, the candidate chosen (`auto` included) and
//! opened, the tokens, the layers, the faults, the globs and the reference cache's key.

use std::ops::Range;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use super::judge::wants_with_scores;
use super::tokens::prompt_tokens;
use crate::driver::Plan;
use crate::explain::fault::Fault;
use crate::gguf::Model;
use crate::model::{HParams, Weights};
use crate::tokenizer::Tokenizer;
use crate::trace::cache::{CacheKey, RefCache};
use crate::trace::TraceFile;
use crate::util::cache_dir::default_dir;
pub use crate::words::{Against, CudaDtype, Modes, PrecisionOverride};

/// Which hooks a comparison keeps and how it judges them (`--hook`, `--tol`, `--precision`;
/// `run` and `compare` share them).
#[derive(Clone, Debug, Default)]
pub struct HookOptions {
    /// Hook globs (all standard hooks when empty).
    pub hook: Vec<String>,
    /// Floor overrides `(glob, relative L2)`.
    pub tol: Vec<(String, f64)>,
    /// Candidate precision overrides.
    pub precision: Vec<PrecisionOverride>,
}

/// What a run is asked to do, as plain values (unchecked).
#[derive(Clone, Debug)]
pub struct RunRequest {
    /// The model (any shard of a split model).
    pub model: PathBuf,
    /// Prompt text.
    pub prompt: Option<String>,
    /// Token ids.
    pub tokens: Option<Vec<u32>>,
    /// Layers `A..B` to run (`--layer N` is `N..N+1`); all when `None`.
    pub layers: Option<Range<u64>>,
    /// The candidate.
    pub against: Against,
    /// `--devices`: the CUDA engine over these devices.
    pub devices: Vec<usize>,
    /// The modes.
    pub mode: Modes,
    /// The CUDA engine's precision.
    pub dtype: CudaDtype,
    /// `--inject` faults, as written.
    pub inject: Vec<String>,
    /// `--explain`.
    pub explain: bool,
    /// `--repro DIR`.
    pub repro: Option<PathBuf>,
    /// Hooks, floors and precisions.
    pub hooks: HookOptions,
    /// `--cache-dir` (default: [`default_dir`]).
    pub cache_dir: Option<PathBuf>,
    /// `--no-cache`.
    pub no_cache: bool,
}

/// The candidate a checked run compares against.
pub(super) enum Chosen {
    /// A second CPU reference.
    Cpu,
    /// The CUDA engine: `device` as asked (its spec `cuda:N`), run over `devices`.
    Cuda { device: usize, devices: Vec<usize> },
    /// A trace file, open.
    Trace { path: PathBuf, file: TraceFile },
}

/// A run checked and ready: the model open, the candidate chosen, the tokens, layers, plan,
/// faults and overrides known good.
pub struct RunConfig {
    pub(super) model_path: PathBuf,
    pub(super) model: Model,
    pub(super) tokenizer: Option<Tokenizer>,
    pub(super) tokens: Vec<u32>,
    pub(super) candidate: Chosen,
    /// Notes of the choices made (`--against auto`), first under the header.
    pub(super) notes: Vec<String>,
    pub(super) mode: Modes,
    /// Read only where the CUDA engine is built.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(super) dtype: CudaDtype,
    pub(super) layers: Range<usize>,
    pub(super) plan: Plan,
    pub(super) faults: Vec<Fault>,
    pub(super) explain: bool,
    pub(super) repro: Option<PathBuf>,
    pub(super) hook: Vec<String>,
    pub(super) tol: Vec<(String, f64)>,
    pub(super) precision: Vec<crate::compare::PrecisionOverride>,
    /// The reference cache and this run's entry (a run from layer 0 or `--no-cache`: none).
    pub(super) cache: Option<(RefCache, CacheKey)>,
}

impl RunConfig {
    /// Checks everything `req` asks before any work: the flags against each other, the `--repro`
    /// target, the model, the candidate (the `auto` choice included; a trace is opened and
    /// checked against the model and the tokens), the tokens, the layers, the faults, the
    /// globs, the precisions and the reference cache's key.
    pub fn check(req: RunRequest) -> Result<RunConfig> {
        let against = against_with_devices(&req)?;
        let faults: Vec<Fault> = req
            .inject
            .iter()
            .map(|s| Fault::parse(s))
            .collect::<Result<_>>()?;
        if (req.explain || req.repro.is_some()) && !req.mode.replay {
            bail!(
                "run: --explain and --repro work on the first step that fails in replay; use --mode replay or both"
            );
        }
        if let Some(dir) = &req.repro {
            crate::explain::case::check_target(dir)?;
        }
        let model = Model::open(&req.model)?;
        let weights = Weights::new(&model)?;
        let hp = weights.hparams();
        let tokenizer = Tokenizer::from_model(&model);
        let asked = prompt_tokens(&req.tokens, &req.prompt, &tokenizer, "run")?;
        let mut notes = Vec::new();
        let candidate = choose(against, &req, asked.as_ref(), &mut notes)?;
        check_candidate(&candidate, &req, &faults)?;
        let tokens = run_tokens(asked, &candidate)?;
        crate::driver::check_tokens(&weights, &tokens).context("run")?;
        if let Chosen::Trace { file, .. } = &candidate {
            crate::trace::check::check_against_model(file, &weights, &tokens)?;
            notes.extend(crate::trace::digest::name_note(
                file.path(),
                file.metadata(),
                &model,
            ));
        }
        let layers = layer_range(req.layers.clone(), hp)?;
        let plan = Plan::range(&weights, layers.clone(), layers.end == hp.n_layer)?;
        for f in &faults {
            f.check(&weights, layers.clone(), plan.tail)?;
        }
        check_globs(
            "run",
            &format!("this run (layers {}..{})", layers.start, layers.end),
            &plan_hooks(&plan, hp),
            &req.hooks,
        )?;
        let precision = req.hooks.precision.clone();
        let cache = reference_cache(&req, &model, &tokens, &plan)?;
        drop(weights);
        Ok(RunConfig {
            model_path: req.model,
            model,
            tokenizer: tokenizer.ok(),
            tokens,
            candidate,
            notes,
            mode: req.mode,
            dtype: req.dtype,
            layers,
            plan,
            faults,
            explain: req.explain,
            repro: req.repro,
            hook: req.hooks.hook,
            tol: req.hooks.tol,
            precision,
            cache,
        })
    }

    /// One line saying what the run will do, before it does it (a log's first sign of life):
    /// `glmdiff run: MODEL (ARCH), layers A..B, T tokens, against SPEC, mode M`.
    pub fn summary(&self) -> String {
        let against = match &self.candidate {
            Chosen::Cpu => "cpu".to_string(),
            Chosen::Cuda { device, .. } => format!("cuda:{device}"),
            Chosen::Trace { path, .. } => format!("trace:{}", path.display()),
        };
        format!(
            "glmdiff run: {} ({}), layers {}..{}, {} tokens, against {against}, mode {}",
            self.model_path.display(),
            self.model.architecture().unwrap_or("unknown architecture"),
            self.layers.start,
            self.layers.end,
            self.tokens.len(),
            self.mode.as_str()
        )
    }

    /// The model's tokenizer, when it has one.
    pub fn tokenizer(&self) -> Option<&Tokenizer> {
        self.tokenizer.as_ref()
    }

    /// The prompt tokens the run compares.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// The model's weight descriptions (read again from the open model: metadata only, checked
    /// once already).
    pub(super) fn weights(&self) -> Result<Weights<'_>> {
        Weights::new(&self.model)
    }
}

/// `--against` with `--devices`: the devices imply the CUDA engine (on the first of them), and
/// only `cuda` or `cuda:N` with N the first device may be said beside them.
fn against_with_devices(req: &RunRequest) -> Result<Against> {
    if !cfg!(feature = "cuda") {
        if let Against::Cuda(_) = req.against {
            bail!(
                "run: --against {}: this glmdiff was built without the `cuda` feature",
                req.against
            );
        }
        if !req.devices.is_empty() {
            bail!(
                "run: --devices {:?}: this glmdiff was built without the `cuda` feature",
                req.devices
            );
        }
    }
    let Some(&first) = req.devices.first() else {
        return Ok(req.against.clone());
    };
    match req.against {
        Against::Auto => Ok(Against::Cuda(Some(first))),
        Against::Cuda(None) => Ok(Against::Cuda(None)),
        Against::Cuda(Some(n)) if n == first => Ok(Against::Cuda(Some(n))),
        _ => bail!(
            "run: --devices {:?} runs the CUDA engine: give --against cuda (or leave --against out), not --against {}",
            req.devices,
            req.against
        ),
    }
}

/// The candidate `against` names, opened (the CUDA engine over `--devices`, else over its one
/// device); `auto` picks the CUDA engine on device 0 when a device is present, else the first
/// trace beside the model made for it (and for `tokens`, when given), and says so in `notes`.
fn choose(
    against: Against,
    req: &RunRequest,
    tokens: Option<&Vec<u32>>,
    notes: &mut Vec<String>,
) -> Result<Chosen> {
    let cuda = |device: usize| Chosen::Cuda {
        device,
        devices: if req.devices.is_empty() {
            vec![device]
        } else {
            req.devices.clone()
        },
    };
    let model = &req.model;
    Ok(match against {
        Against::Cpu => Chosen::Cpu,
        Against::Cuda(n) => cuda(n.unwrap_or(0)),
        Against::Trace(path) => {
            let file = TraceFile::open(&path)?;
            Chosen::Trace { path, file }
        }
        Against::Auto if cuda_device_present() => {
            notes.push("--against auto: a CUDA device is present; comparing with the CUDA engine on device 0".to_string());
            cuda(0)
        }
        Against::Auto => {
            let found = traces_beside(model)
                .into_iter()
                .find(|(_, t)| tokens.is_none_or(|want| t.tokens().ok().as_ref() == Some(want)));
            let Some((path, file)) = found else {
                bail!(
                    "run: --against auto: no CUDA device, and no trace beside {} made for this model{}; give --against cpu or --against trace:FILE",
                    model.display(),
                    if tokens.is_some() { " and these tokens" } else { "" }
                );
            };
            notes.push(format!(
                "--against auto: no CUDA device; using the trace {} shipped beside the model",
                path.display()
            ));
            Chosen::Trace { path, file }
        }
    })
}

/// The checks of the candidate against the other flags: the CUDA libraries (said before any
/// work, in the words of every GPU command), `--inject` only into an engine, `--dtype` only
/// for the CUDA engine.
fn check_candidate(candidate: &Chosen, req: &RunRequest, faults: &[Fault]) -> Result<()> {
    #[cfg(feature = "cuda")]
    if let Chosen::Cuda { .. } = candidate {
        crate::gpu::probe_libraries()?;
    }
    if !faults.is_empty() && matches!(candidate, Chosen::Trace { .. }) {
        bail!(
            "run: --inject plants a bug in an engine glmdiff runs (--against cpu or cuda); a trace's bugs are its own"
        );
    }
    if req.dtype != CudaDtype::F32 && !matches!(candidate, Chosen::Cuda { .. }) {
        bail!(
            "run: --dtype {} sets the CUDA engine's precision; give --against cuda",
            req.dtype
        );
    }
    Ok(())
}

/// The tokens compared: those asked, or a trace candidate's own (which must then be the same).
fn run_tokens(asked: Option<Vec<u32>>, candidate: &Chosen) -> Result<Vec<u32>> {
    let mut tokens = asked;
    if let Chosen::Trace { file, .. } = candidate {
        let tt = file.tokens()?;
        match &tokens {
            None => tokens = Some(tt),
            Some(mine) if *mine != tt => bail!(
                "run: the trace {} was made for tokens {:?}, not {:?}",
                file.path().display(),
                tt,
                mine
            ),
            _ => {}
        }
    }
    tokens.context("run: give --tokens or --prompt (or a trace candidate, whose tokens are used)")
}

/// The layers run: those asked (within the model's), or all.
fn layer_range(asked: Option<Range<u64>>, hp: &HParams) -> Result<Range<usize>> {
    let layers = asked.unwrap_or(0..hp.n_layer as u64);
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
    Ok(layers.start as usize..layers.end as usize)
}

/// The reference cache and the key of this run's entry, when the plan starts past layer 0 and
/// the cache is not turned off.
fn reference_cache(
    req: &RunRequest,
    model: &Model,
    tokens: &[u32],
    plan: &Plan,
) -> Result<Option<(RefCache, CacheKey)>> {
    if req.no_cache || plan.free_inputs().is_empty() {
        return Ok(None);
    }
    let dir = match &req.cache_dir {
        Some(d) => d.clone(),
        None => default_dir()?,
    };
    Ok(Some((
        RefCache::new(&dir),
        CacheKey::new(model, tokens, plan.first_layer)?,
    )))
}

/// The trace files (`*.trace.safetensors`) beside `model`, sorted: those `--against auto` may
/// pick (it opens them to keep those made for the model).
pub fn trace_files_beside(model: &Path) -> Vec<PathBuf> {
    let Some(dir) = model.parent() else {
        return Vec::new();
    };
    let dir = if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    };
    let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.to_string_lossy().ends_with(".trace.safetensors"))
                .collect()
        })
        .unwrap_or_default();
    paths.sort();
    paths
}

/// Traces beside `model` made for it (metadata `models` or `model` names its file), sorted.
fn traces_beside(model: &Path) -> Vec<(PathBuf, TraceFile)> {
    let file = model
        .file_name()
        .map(|f| f.to_string_lossy().into_owned())
        .unwrap_or_default();
    trace_files_beside(model)
        .into_iter()
        .filter_map(|p| {
            let t = TraceFile::open(&p).ok()?;
            crate::trace::digest::names_model_file(t.metadata(), &file)?.then_some((p, t))
        })
        .collect()
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

/// Every hook `plan` can produce: its steps' outputs, and the optional attention probabilities
/// and per-expert outputs of its layers.
pub(super) fn plan_hooks(plan: &Plan, hp: &HParams) -> Vec<String> {
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
pub(super) fn check_globs(
    cmd: &str,
    scope: &str,
    hooks: &[String],
    opts: &HookOptions,
) -> Result<()> {
    const NAMES: &str = "hook names are blk.L.<point>, token_embd, result_norm, logits";
    for g in &opts.hook {
        if !hooks.iter().any(|h| crate::util::glob::matches(g, h)) {
            bail!("{cmd}: --hook {g:?} matches no hook of {scope}; {NAMES}");
        }
    }
    let wants = wants_with_scores(&opts.hook);
    let compared: Vec<&String> = hooks.iter().filter(|h| wants(h)).collect();
    let flags = opts
        .tol
        .iter()
        .map(|(g, _)| ("--tol", g))
        .chain(opts.precision.iter().map(|o| ("--precision", &o.glob)));
    for (flag, g) in flags {
        if !compared.iter().any(|h| crate::util::glob::matches(g, h)) {
            bail!(
                "{cmd}: {flag} glob {g:?} matches none of the hooks compared in {scope}; {NAMES}"
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn against_parses_every_form_and_says_it_back() {
        for s in ["auto", "cpu", "cuda", "cuda:3", "trace:a/b.safetensors"] {
            assert_eq!(Against::parse(s).unwrap().to_string(), s);
        }
        assert_eq!(Against::parse("cuda").unwrap(), Against::Cuda(None));
        assert_eq!(Against::parse("cuda:0").unwrap(), Against::Cuda(Some(0)));
        for (bad, needle) in [
            ("cuda:x", "cuda:N with N a device index"),
            ("cuda:-1", "cuda:N with N a device index"),
            ("trace:", "needs a file"),
            ("gpu", "expected auto, cpu, cuda[:N] or trace:FILE"),
        ] {
            let e = format!("{:#}", Against::parse(bad).unwrap_err());
            assert!(e.contains(needle), "{bad}: {e}");
        }
    }

    #[test]
    fn devices_imply_the_cuda_engine_on_the_first_device() {
        let req = |against: &str, devices: Vec<usize>| RunRequest {
            model: PathBuf::from("m.gguf"),
            prompt: None,
            tokens: None,
            layers: None,
            against: Against::parse(against).unwrap(),
            devices,
            mode: Modes::BOTH,
            dtype: CudaDtype::F32,
            inject: Vec::new(),
            explain: false,
            repro: None,
            hooks: HookOptions::default(),
            cache_dir: None,
            no_cache: false,
        };
        if !cfg!(feature = "cuda") {
            let e = against_with_devices(&req("auto", vec![1])).unwrap_err();
            assert!(e.to_string().contains("without the `cuda` feature"), "{e}");
            return;
        }
        assert_eq!(
            against_with_devices(&req("auto", vec![1, 2])).unwrap(),
            Against::Cuda(Some(1))
        );
        assert_eq!(
            against_with_devices(&req("cuda", vec![1, 2])).unwrap(),
            Against::Cuda(None)
        );
        assert_eq!(
            against_with_devices(&req("cuda:1", vec![1, 2])).unwrap(),
            Against::Cuda(Some(1))
        );
        assert_eq!(
            against_with_devices(&req("cpu", vec![])).unwrap(),
            Against::Cpu
        );
        for bad in ["cpu", "cuda:2", "trace:t.safetensors"] {
            let e = against_with_devices(&req(bad, vec![1, 2])).unwrap_err();
            assert!(
                e.to_string().contains(&format!(
                    "give --against cuda (or leave --against out), not --against {bad}"
                )),
                "{e}"
            );
        }
    }
}
