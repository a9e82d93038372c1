//! The error-per-layer plot of `glmdiff run --plot FILE.svg`: one SVG with the layers along x and
//! the relative L2 error on a log scale along y, the replay and chained series, the tolerance
//! floor as a dashed step and failed layers shaded red. The caller hands over plain numbers
//! ([`ErrorPlot`]); nothing here computes a metric.
//!
//! Values a log axis cannot place are still drawn: an error of exactly 0 sits on the bottom edge
//! as a down-pointing triangle ("0 = identical"), and NaN, ±inf or a negative value (no relative
//! L2 error is negative) sits on the top edge as a cross. Lines connect zeros but break at
//! invalid values and at layers that were not run.
//!
//! Both axes are small [`Ranged`] implementations of our own rather than plotters' `LogCoord`
//! and segmented coordinates, so that y ticks fall on whole decades only (`1e-8` ... `1e0`) and
//! x labels on the layers we choose (named stages such as `embd` and `out` always, numbered
//! layers thinned so that labels never overlap).
//!
//! Text needs no plotters font feature: the SVG backend writes `<text>` elements that the viewer
//! lays out with its own fonts, and without `ttf` / `ab_glyph` plotters sizes label areas with a
//! built-in estimate (no font files, no system libraries). The image width grows with the number
//! of layers, and the legend has its own column, so it never covers data.

use std::ops::Range;
use std::path::Path;

use anyhow::{bail, Context, Result};
use plotters::coord::ranged1d::{DefaultFormatting, KeyPointHint, KeyPointWeight, Ranged};
use plotters::coord::Shift;
use plotters::element::DashedPathElement;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use crate::util::atomic::write_atomic;

/// What the plot shows: a title and one point per x position, left to right.
#[derive(Debug, Clone, PartialEq)]
pub struct ErrorPlot {
    /// Drawn above the chart, e.g. `glm5-tiny-q-mixed.gguf: cpu vs trace:x.safetensors`.
    pub title: String,
    /// One per x position in model order: usually an optional `embd`, the layers, then `out`.
    pub points: Vec<LayerPoint>,
}

/// One x position of the plot: a layer, or a stage before or after the layers.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerPoint {
    /// Axis label: `"0"`, `"1"`, ... or a stage name such as `"embd"` / `"out"`.
    pub label: String,
    /// Worst relative L2 error over this layer's hooks in replay mode; `None`: not run.
    pub replay: Option<f64>,
    /// Worst relative L2 error over this layer's hooks in chained mode; `None`: not run.
    pub chained: Option<f64>,
    /// Tolerance floor (relative L2) of the worst hook at this layer. A floor of 0 is drawn on
    /// the bottom edge; a non-finite or negative floor is not drawn.
    pub floor: f64,
    /// Whether a hook of this layer failed: its column is shaded and its markers ringed in red.
    pub failed: bool,
}

/// Renders `plot` as a standalone SVG document.
pub fn render_svg(plot: &ErrorPlot) -> Result<String> {
    if plot.points.is_empty() {
        bail!("plot: no layers to draw (the error-per-layer plot needs at least one point)");
    }
    let layout = Layout::new(plot);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (layout.width, HEIGHT)).into_drawing_area();
        draw(&root, plot, &layout).with_context(|| {
            format!(
                "plot: cannot draw the error-per-layer chart ({} points)",
                plot.points.len()
            )
        })?;
        root.present()
            .context("plot: cannot finish the SVG document")?;
    }
    Ok(svg)
}

/// Renders `plot` and writes it to `path` atomically (a failed write leaves no partial file).
pub fn write_svg(plot: &ErrorPlot, path: &Path) -> Result<()> {
    let svg = render_svg(plot)?;
    write_atomic(path, |w| {
        w.write_all(svg.as_bytes())
            .with_context(|| format!("plot: cannot write {}", path.display()))
    })
}

// ---- geometry and style -------------------------------------------------------------------

/// Image height in pixels; the width grows with the number of layers.
const HEIGHT: u32 = 560;
/// Width of the chart part (axes included) for few layers.
const MIN_CHART_W: u32 = 660;
/// Horizontal room per layer, so that 78 layers stay readable.
const PX_PER_POINT: u32 = 14;
/// Width of the legend column right of the chart: the legend never covers data.
const LEGEND_W: u32 = 250;
/// Space around the chart inside its area.
const MARGIN: u32 = 16;
/// Room left of the plotting area for the y tick labels and the y axis name.
const Y_LABEL_AREA: u32 = 72;
/// Room below the plotting area for the x tick labels and the x axis name.
const X_LABEL_AREA: u32 = 52;
/// plotters-svg writes `font-size = size / 1.24`; sizes here are given in rendered pixels.
const SVG_FONT_SCALE: f64 = 1.24;
/// Rendered size of tick labels and legend text, in pixels.
const LABEL_PX: f64 = 12.0;
/// Rough advance of one character of sans-serif text, as a fraction of its size: only used to
/// keep labels apart, the viewer lays the text out.
const CHAR_EM: f64 = 0.62;
/// At most this many labelled decades on the y axis; wider ranges label every 2nd, 5th... one.
const MAX_Y_LABELS: i32 = 10;
/// The y range when no value is positive and finite (all zero, invalid or not run).
const DEFAULT_DECADES: (i32, i32) = (-8, 0);

const REPLAY: RGBColor = RGBColor(0, 114, 178);
const CHAINED: RGBColor = RGBColor(230, 159, 0);
const FLOOR: RGBColor = RGBColor(80, 80, 80);
const FAILED: RGBColor = RGBColor(200, 0, 0);
const FAILED_BAND: RGBAColor = RGBAColor(220, 0, 0, 0.10);
const NOTE: RGBColor = RGBColor(100, 100, 100);
const GRID_BOLD: RGBColor = RGBColor(205, 205, 205);
const GRID_LIGHT: RGBColor = RGBColor(236, 236, 236);

/// A sans-serif text style of `px` rendered pixels.
fn font(px: f64) -> TextStyle<'static> {
    ("sans-serif", px * SVG_FONT_SCALE).into_font().into()
}

/// Rough rendered width of `text` at `px` pixels.
fn text_width(text: &str, px: f64) -> f64 {
    text.chars().count() as f64 * px * CHAR_EM
}

/// Sizes and axis ranges decided from the data before drawing.
struct Layout {
    width: u32,
    chart_w: u32,
    x: LayerAxis,
    y: DecadeAxis,
}

impl Layout {
    fn new(plot: &ErrorPlot) -> Self {
        let n = plot.points.len();
        let n_px = u32::try_from(n)
            .unwrap_or(u32::MAX)
            .saturating_mul(PX_PER_POINT);
        let chart_w = MIN_CHART_W.max(n_px.saturating_add(Y_LABEL_AREA + 2 * MARGIN));
        let px_per_point = f64::from(chart_w - Y_LABEL_AREA - 2 * MARGIN) / n as f64;
        let labels: Vec<&str> = plot.points.iter().map(|p| p.label.as_str()).collect();
        let values = plot
            .points
            .iter()
            .flat_map(|p| [p.replay, p.chained, Some(p.floor)].into_iter().flatten());
        let (lo, hi) = decade_range(values);
        Layout {
            width: chart_w + LEGEND_W,
            chart_w,
            x: LayerAxis {
                n,
                labelled: choose_labels(&labels, px_per_point),
            },
            y: DecadeAxis {
                lo,
                hi,
                step: decade_step(hi - lo),
            },
        }
    }
}

// ---- values on the log axis ---------------------------------------------------------------

/// Where a value lands on the log axis.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Level {
    /// A positive finite value: its log10.
    Log(f64),
    /// Exactly zero: drawn on the bottom edge.
    Zero,
    /// NaN, ±inf or negative: drawn on the top edge.
    Invalid,
}

fn level(v: f64) -> Level {
    if !v.is_finite() || v < 0.0 {
        Level::Invalid
    } else if v == 0.0 {
        Level::Zero
    } else {
        Level::Log(v.log10())
    }
}

/// The y range in whole decades: from a decade below the smallest positive finite value to the
/// decade above the largest, so that no point sits on an edge (edges are kept for 0 and invalid
/// values).
fn decade_range(values: impl Iterator<Item = f64>) -> (i32, i32) {
    // log10 of an exact power of ten may land a hair below the integer.
    const EPS: f64 = 1e-9;
    let (mut min, mut max) = (f64::INFINITY, f64::NEG_INFINITY);
    for v in values {
        if let Level::Log(l) = level(v) {
            min = min.min(l);
            max = max.max(l);
        }
    }
    if min > max {
        return DEFAULT_DECADES;
    }
    (
        (min + EPS).floor() as i32 - 1,
        (max + EPS).floor() as i32 + 1,
    )
}

/// The labelled-decade spacing for a range of `span` decades.
fn decade_step(span: i32) -> i32 {
    [1, 2, 3, 5, 10, 20, 50, 100]
        .into_iter()
        .find(|s| span / s <= MAX_Y_LABELS)
        .unwrap_or(200)
}

/// The y axis: log10 of the error, from decade `lo` to decade `hi`; ticks and labels on every
/// `step`-th decade, light grid lines on the others (and on 2..9 × 10^k when every decade is
/// labelled).
#[derive(Clone)]
struct DecadeAxis {
    lo: i32,
    hi: i32,
    step: i32,
}

impl DecadeAxis {
    /// The axis value where `level` is drawn (edges for zero and invalid values).
    fn y(&self, level: Level) -> f64 {
        match level {
            Level::Log(l) => l,
            Level::Zero => f64::from(self.lo),
            Level::Invalid => f64::from(self.hi),
        }
    }
}

impl Ranged for DecadeAxis {
    type FormatOption = DefaultFormatting;
    type ValueType = f64;

    fn map(&self, value: &f64, limit: (i32, i32)) -> i32 {
        linear(*value, f64::from(self.lo), f64::from(self.hi), limit)
    }

    fn key_points<Hint: KeyPointHint>(&self, hint: Hint) -> Vec<f64> {
        let decades = self.lo..=self.hi;
        match hint.weight() {
            KeyPointWeight::Bold => decades
                .filter(|d| d.rem_euclid(self.step) == 0)
                .map(f64::from)
                .collect(),
            KeyPointWeight::Any if self.step == 1 => decades
                .flat_map(|d| (1..=9).map(move |k| f64::from(d) + f64::from(k).log10()))
                .filter(|&v| v <= f64::from(self.hi))
                .collect(),
            KeyPointWeight::Any => decades.map(f64::from).collect(),
        }
    }

    fn range(&self) -> Range<f64> {
        f64::from(self.lo)..f64::from(self.hi)
    }
}

// ---- the layer axis -----------------------------------------------------------------------

/// The x axis: positions `0..n`, one per point, each in a cell one unit wide; ticks and labels
/// only at `labelled`.
#[derive(Clone)]
struct LayerAxis {
    n: usize,
    labelled: Vec<usize>,
}

impl Ranged for LayerAxis {
    type FormatOption = DefaultFormatting;
    type ValueType = f64;

    fn map(&self, value: &f64, limit: (i32, i32)) -> i32 {
        linear(*value, -0.5, self.n as f64 - 0.5, limit)
    }

    fn key_points<Hint: KeyPointHint>(&self, _hint: Hint) -> Vec<f64> {
        self.labelled.iter().map(|&i| i as f64).collect()
    }

    fn range(&self) -> Range<f64> {
        -0.5..self.n as f64 - 0.5
    }
}

/// Maps `v` in `start..end` linearly onto the pixel range `limit`.
fn linear(v: f64, start: f64, end: f64, (a, b): (i32, i32)) -> i32 {
    let t = (v - start) / (end - start);
    a + (f64::from(b - a) * t).round() as i32
}

/// Which positions get an x label, `px_per_point` pixels apart. Named stages (`embd`, `out`),
/// the first and the last point always; numbered layers every `step`-th (1, 2, 5, 10, ... the
/// smallest that fits the widest number); then any label that would overlap one already placed
/// is dropped.
fn choose_labels(labels: &[&str], px_per_point: f64) -> Vec<usize> {
    const GAP_PX: f64 = 6.0;
    let n = labels.len();
    let number = |i: usize| labels[i].parse::<i64>().ok();
    let widest_number = (0..n)
        .filter(|&i| number(i).is_some())
        .map(|i| text_width(labels[i], LABEL_PX))
        .fold(0.0, f64::max);
    let step = [1, 2, 5, 10, 20, 50, 100, 200, 500]
        .into_iter()
        .find(|&s| s as f64 * px_per_point >= widest_number + GAP_PX)
        .unwrap_or(1000);

    let mut candidates: Vec<usize> = vec![0, n - 1];
    candidates.extend((0..n).filter(|&i| number(i).is_none()));
    candidates.extend((0..n).filter(|&i| number(i).is_some_and(|v| v % step == 0)));

    let mut placed: Vec<(usize, f64, f64)> = Vec::new();
    for i in candidates {
        let centre = i as f64 * px_per_point;
        let half = text_width(labels[i], LABEL_PX) / 2.0 + GAP_PX / 2.0;
        let (left, right) = (centre - half, centre + half);
        let clear = placed
            .iter()
            .all(|&(j, l, r)| j != i && (right <= l || left >= r));
        if clear {
            placed.push((i, left, right));
        }
    }
    let mut chosen: Vec<usize> = placed.into_iter().map(|(i, _, _)| i).collect();
    chosen.sort_unstable();
    chosen
}

// ---- drawing ------------------------------------------------------------------------------

type Area<'a> = DrawingArea<SVGBackend<'a>, Shift>;

/// Which series a marker belongs to: replay is drawn filled, chained hollow, so that equal
/// values stay visible (the filled marker sits inside the hollow one).
#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Replay,
    Chained,
}

impl Mode {
    fn colour(self) -> RGBColor {
        match self {
            Mode::Replay => REPLAY,
            Mode::Chained => CHAINED,
        }
    }

    fn value(self, p: &LayerPoint) -> Option<f64> {
        match self {
            Mode::Replay => p.replay,
            Mode::Chained => p.chained,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Mode::Replay => "replay",
            Mode::Chained => "chained",
        }
    }
}

/// A marker shape in pixel offsets from its anchor point.
#[derive(Clone, Copy)]
enum Shape {
    /// The normal value marker of the series (circle for replay, triangle for chained).
    Value,
    /// Error = 0: a triangle pointing down onto the bottom edge.
    Zero,
    /// NaN / inf / negative: a cross just under the top edge.
    Invalid,
}

/// The marker of `mode` in `shape` and `colour`, anchored at `at` (data or pixel coordinates).
fn marker<'a, C: Clone + 'static>(
    at: C,
    mode: Mode,
    shape: Shape,
    colour: RGBColor,
) -> DynElement<'a, SVGBackend<'a>, C> {
    let filled = mode == Mode::Replay;
    let style = if filled {
        colour.filled()
    } else {
        colour.stroke_width(2)
    };
    let outline = |pts: &[(i32, i32)]| {
        let mut closed = pts.to_vec();
        closed.push(pts[0]);
        PathElement::new(closed, colour.stroke_width(2))
    };
    match (shape, filled) {
        (Shape::Value, true) => (EmptyElement::at(at) + Circle::new((0, 0), 4, style)).into_dyn(),
        (Shape::Value, false) => {
            (EmptyElement::at(at) + outline(&[(0, -7), (6, 4), (-6, 4)])).into_dyn()
        }
        (Shape::Zero, true) => (EmptyElement::at(at)
            + Polygon::new(vec![(-5, -10), (5, -10), (0, -1)], style))
        .into_dyn(),
        (Shape::Zero, false) => {
            (EmptyElement::at(at) + outline(&[(-8, -14), (8, -14), (0, -1)])).into_dyn()
        }
        (Shape::Invalid, _) => {
            // Replay's cross sits just under the top edge, chained's below it: crosses cannot
            // nest like filled and hollow shapes.
            let dy = if filled { 7 } else { 20 };
            let line = |a: (i32, i32), b: (i32, i32)| {
                PathElement::new(
                    vec![(a.0, a.1 + dy), (b.0, b.1 + dy)],
                    colour.stroke_width(2),
                )
            };
            (EmptyElement::at(at) + line((-5, -5), (5, 5)) + line((-5, 5), (5, -5))).into_dyn()
        }
    }
}

fn draw(root: &Area, plot: &ErrorPlot, layout: &Layout) -> Result<()> {
    root.fill(&WHITE)?;
    let title_px = (f64::from(layout.width - 2 * MARGIN)
        / (plot.title.chars().count().max(1) as f64 * CHAR_EM))
        .clamp(9.0, 18.0);
    let body = root.titled(&plot.title, font(title_px).color(&BLACK))?;
    let (chart_area, legend_area) = body.split_horizontally(layout.chart_w);

    let (lo, hi) = (f64::from(layout.y.lo), f64::from(layout.y.hi));
    let mut chart = ChartBuilder::on(&chart_area)
        .margin(MARGIN)
        .x_label_area_size(X_LABEL_AREA)
        .y_label_area_size(Y_LABEL_AREA)
        .build_cartesian_2d(layout.x.clone(), layout.y.clone())?;

    // Failed layers first, under the grid and the data.
    chart.draw_series(
        plot.points
            .iter()
            .enumerate()
            .filter(|(_, p)| p.failed)
            .map(|(i, _)| {
                let x = i as f64;
                Rectangle::new([(x - 0.5, lo), (x + 0.5, hi)], FAILED_BAND.filled())
            }),
    )?;

    let x_label = |v: &f64| {
        let i = v.round();
        if i >= 0.0 && (i as usize) < plot.points.len() {
            plot.points[i as usize].label.clone()
        } else {
            String::new()
        }
    };
    let y_label = |v: &f64| format!("1e{}", v.round() as i64);
    chart
        .configure_mesh()
        .x_desc("layer")
        .y_desc("relative L2 error")
        .x_label_formatter(&x_label)
        .y_label_formatter(&y_label)
        .label_style(font(LABEL_PX))
        .axis_desc_style(font(14.0))
        .bold_line_style(GRID_BOLD)
        .light_line_style(GRID_LIGHT)
        .axis_style(BLACK)
        .draw()?;

    // Tolerance floor: a dashed step across each layer's cell, broken where there is none.
    for run in runs(&plot.points, |p| !matches!(level(p.floor), Level::Invalid)) {
        let steps: Vec<(f64, f64)> = run
            .flat_map(|i| {
                let y = layout.y.y(level(plot.points[i].floor));
                let x = i as f64;
                [(x - 0.5, y), (x + 0.5, y)]
            })
            .collect();
        chart.draw_series(DashedLineSeries::new(steps, 6, 4, FLOOR.stroke_width(2)))?;
    }

    for mode in [Mode::Chained, Mode::Replay] {
        let colour = mode.colour();
        let drawable = |p: &LayerPoint| {
            mode.value(p)
                .is_some_and(|v| !matches!(level(v), Level::Invalid))
        };
        for run in runs(&plot.points, drawable) {
            let line: Vec<(f64, f64)> = run
                .filter_map(|i| {
                    let v = mode.value(&plot.points[i])?;
                    Some((i as f64, layout.y.y(level(v))))
                })
                .collect();
            chart.draw_series(LineSeries::new(line, colour.mix(0.8).stroke_width(1)))?;
        }
        for (i, p) in plot.points.iter().enumerate() {
            let Some(v) = mode.value(p) else { continue };
            let lv = level(v);
            let at = (i as f64, layout.y.y(lv));
            let shape = match lv {
                Level::Log(_) => Shape::Value,
                Level::Zero => Shape::Zero,
                Level::Invalid => Shape::Invalid,
            };
            if p.failed && matches!(lv, Level::Log(_)) {
                chart
                    .plotting_area()
                    .draw(&Circle::new(at, 9, FAILED.stroke_width(2)))?;
            }
            chart
                .plotting_area()
                .draw(&marker(at, mode, shape, colour))?;
        }
    }

    draw_legend(&legend_area, plot)?;
    Ok(())
}

/// Maximal runs of consecutive positions where `keep` holds.
fn runs<'p>(
    points: &'p [LayerPoint],
    keep: impl Fn(&LayerPoint) -> bool + 'p,
) -> impl Iterator<Item = Range<usize>> + 'p {
    let mut i = 0;
    std::iter::from_fn(move || {
        while i < points.len() && !keep(&points[i]) {
            i += 1;
        }
        if i == points.len() {
            return None;
        }
        let start = i;
        while i < points.len() && keep(&points[i]) {
            i += 1;
        }
        Some(start..i)
    })
}

/// The legend, in its own column right of the chart: one row per series, the floor, and a note
/// for each special marker that the data actually uses.
fn draw_legend(area: &Area, plot: &ErrorPlot) -> Result<()> {
    const ROW_PX: i32 = 26;
    const SAMPLE_X: i32 = 12;
    const SAMPLE_W: i32 = 36;
    let text_x = SAMPLE_X + SAMPLE_W + 12;
    let mid = SAMPLE_X + SAMPLE_W / 2;
    let text = |s: &str, y: i32| {
        let style = font(LABEL_PX + 1.0)
            .color(&BLACK)
            .pos(Pos::new(HPos::Left, VPos::Center));
        Text::new(s.to_string(), (text_x, y), style)
    };

    let mut y = MARGIN as i32 + 8;
    area.draw(&Text::new(
        "worst hook per layer",
        (SAMPLE_X, y),
        font(LABEL_PX)
            .color(&NOTE)
            .pos(Pos::new(HPos::Left, VPos::Center)),
    ))?;
    y += ROW_PX;

    for mode in [Mode::Replay, Mode::Chained] {
        let colour = mode.colour();
        area.draw(&PathElement::new(
            vec![(SAMPLE_X, y), (SAMPLE_X + SAMPLE_W, y)],
            colour.stroke_width(1),
        ))?;
        area.draw(&marker((mid, y), mode, Shape::Value, colour))?;
        let run = plot.points.iter().any(|p| mode.value(p).is_some());
        let label = if run {
            mode.name().to_string()
        } else {
            format!("{} (not run)", mode.name())
        };
        area.draw(&text(&label, y))?;
        y += ROW_PX;
    }

    area.draw(&DashedPathElement::new(
        vec![(SAMPLE_X, y), (SAMPLE_X + SAMPLE_W, y)],
        6,
        4,
        FLOOR.stroke_width(2),
    ))?;
    area.draw(&text("tolerance floor", y))?;
    y += ROW_PX;

    if plot.points.iter().any(|p| p.failed) {
        area.draw(&Rectangle::new(
            [(SAMPLE_X, y - 10), (SAMPLE_X + SAMPLE_W, y + 10)],
            FAILED_BAND.filled(),
        ))?;
        area.draw(&Circle::new((mid, y), 9, FAILED.stroke_width(2)))?;
        area.draw(&text("failed layer", y))?;
        y += ROW_PX;
    }

    let values = || {
        plot.points
            .iter()
            .flat_map(|p| [p.replay, p.chained])
            .flatten()
    };
    if values().any(|v| level(v) == Level::Zero) {
        area.draw(&marker((mid, y + 6), Mode::Replay, Shape::Zero, NOTE))?;
        area.draw(&text("0 = identical", y))?;
        y += ROW_PX;
    }
    if values().any(|v| level(v) == Level::Invalid) {
        area.draw(&marker((mid, y - 7), Mode::Replay, Shape::Invalid, NOTE))?;
        area.draw(&text("not finite (NaN, inf)", y))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn point(label: &str, replay: Option<f64>, chained: Option<f64>) -> LayerPoint {
        LayerPoint {
            label: label.to_string(),
            replay,
            chained,
            floor: 1e-3,
            failed: false,
        }
    }

    /// A model-shaped plot: `embd`, `n_layers` layers, `out`, errors growing with depth.
    fn model(n_layers: usize) -> ErrorPlot {
        let mut points = vec![point("embd", Some(0.0), Some(0.0))];
        for l in 0..n_layers {
            let e = 1e-6 * (1.0 + l as f64).powf(1.5);
            let mut p = point(&l.to_string(), Some(e), Some(e * 3.0));
            p.floor = 2e-3;
            p.failed = e * 3.0 > p.floor;
            points.push(p);
        }
        points.push(point("out", Some(2e-5), Some(4e-2)));
        ErrorPlot {
            title: "glm5-tiny-q-mixed.gguf: cpu vs trace:x.safetensors".to_string(),
            points,
        }
    }

    /// Checks that `svg` is one well-nested `<svg>` element: every opened tag is closed in order
    /// and no attribute value is a number plotters could not have meant (NaN, inf).
    fn check_xml(svg: &str) {
        assert!(
            svg.trim_start().starts_with("<svg"),
            "{}",
            &svg[..80.min(svg.len())]
        );
        assert!(svg.trim_end().ends_with("</svg>"));
        let mut stack: Vec<&str> = Vec::new();
        let mut rest = svg;
        while let Some(start) = rest.find('<') {
            let end = rest[start..].find('>').expect("unclosed tag") + start;
            let tag = &rest[start + 1..end];
            if let Some(name) = tag.strip_prefix('/') {
                assert_eq!(stack.pop(), Some(name.trim()), "mismatched </{name}>");
            } else if !tag.ends_with('/') && !tag.starts_with('?') && !tag.starts_with('!') {
                stack.push(tag.split_whitespace().next().unwrap_or(""));
            }
            rest = &rest[end + 1..];
        }
        assert!(stack.is_empty(), "unclosed: {stack:?}");
        for bad in ["\"NaN", "\"inf", "\"-inf", " NaN", ",NaN"] {
            assert!(
                !svg.contains(bad),
                "non-finite coordinate {bad:?} in the SVG"
            );
        }
    }

    /// The contents of the SVG's `<text>` elements, trimmed.
    fn texts(svg: &str) -> Vec<String> {
        svg.split("<text")
            .skip(1)
            .filter_map(|t| {
                let body = &t[t.find('>')? + 1..];
                Some(body[..body.find("</text>")?].trim().to_string())
            })
            .collect()
    }

    fn has_text(svg: &str, text: &str) -> bool {
        texts(svg).iter().any(|t| t == text)
    }

    #[test]
    fn svg_has_title_series_floor_and_axes() {
        let svg = render_svg(&model(4)).unwrap();
        check_xml(&svg);
        for text in [
            "glm5-tiny-q-mixed.gguf: cpu vs trace:x.safetensors",
            "replay",
            "chained",
            "tolerance floor",
            "layer",
            "relative L2 error",
            "embd",
            "out",
        ] {
            assert!(
                has_text(&svg, text),
                "missing {text:?} in {:?}",
                texts(&svg)
            );
        }
        // Both series colours are used.
        assert!(svg.contains("#0072B2"));
        assert!(svg.contains("#E69F00"));
        // Light and bold grid, decade labels only.
        assert!(texts(&svg).iter().any(|t| t == "1e-3"));
        assert!(!texts(&svg)
            .iter()
            .any(|t| t.starts_with("2e") || t.starts_with("1e-3.")));
    }

    #[test]
    fn zeros_are_drawn_and_explained() {
        let plot = ErrorPlot {
            title: "zeros".to_string(),
            points: vec![
                LayerPoint {
                    floor: 0.0,
                    ..point("0", Some(0.0), Some(0.0))
                },
                LayerPoint {
                    floor: f64::NAN,
                    ..point("1", Some(0.0), None)
                },
            ],
        };
        let svg = render_svg(&plot).unwrap();
        check_xml(&svg);
        assert!(has_text(&svg, "0 = identical"));
        assert!(!svg.contains("not finite"));
        // No positive finite value anywhere: the default range.
        assert!(
            has_text(&svg, "1e-8") && has_text(&svg, "1e0"),
            "{:?}",
            texts(&svg)
        );
    }

    #[test]
    fn non_finite_values_are_drawn_at_the_top_and_explained() {
        let plot = ErrorPlot {
            title: "nan".to_string(),
            points: vec![
                point("0", Some(f64::NAN), Some(1e-4)),
                point("1", Some(f64::INFINITY), Some(f64::NEG_INFINITY)),
                point("2", Some(-1.0), Some(2e-4)),
                LayerPoint {
                    floor: f64::NAN,
                    ..point("3", Some(1e-5), Some(1e-5))
                },
            ],
        };
        let svg = render_svg(&plot).unwrap();
        check_xml(&svg);
        assert!(has_text(&svg, "not finite (NaN, inf)"));
        assert!(!svg.contains("0 = identical"));
    }

    #[test]
    fn one_point_and_eighty_points_render() {
        let one = ErrorPlot {
            title: "one".to_string(),
            points: vec![point("0", Some(1e-3), None)],
        };
        let svg = render_svg(&one).unwrap();
        check_xml(&svg);
        assert!(has_text(&svg, "chained (not run)"));

        let svg = render_svg(&model(78)).unwrap();
        check_xml(&svg);
        assert!(has_text(&svg, "failed layer"));
    }

    #[test]
    fn empty_plot_is_an_error() {
        let e = render_svg(&ErrorPlot {
            title: "x".to_string(),
            points: vec![],
        })
        .unwrap_err();
        assert!(
            format!("{e:#}").contains("plot: no layers to draw"),
            "{e:#}"
        );
    }

    #[test]
    fn title_is_escaped() {
        let plot = ErrorPlot {
            title: "a<b & c>d".to_string(),
            points: vec![point("0", Some(1e-3), Some(1e-3))],
        };
        let svg = render_svg(&plot).unwrap();
        check_xml(&svg);
        assert!(svg.contains("a&lt;b &amp; c&gt;d"));
    }

    #[test]
    fn decade_range_brackets_the_data() {
        let r = |v: &[f64]| decade_range(v.iter().copied());
        assert_eq!(r(&[3e-7, 0.5]), (-8, 0));
        assert_eq!(r(&[1e-3]), (-4, -2));
        assert_eq!(r(&[1.0, 2.0]), (-1, 1));
        assert_eq!(r(&[0.0, f64::NAN, -1.0]), DEFAULT_DECADES);
        assert_eq!(r(&[]), DEFAULT_DECADES);
        assert_eq!(decade_step(8), 1);
        assert_eq!(decade_step(30), 3);
    }

    #[test]
    fn labels_keep_stages_and_never_overlap() {
        let plot = model(78);
        let labels: Vec<&str> = plot.points.iter().map(|p| p.label.as_str()).collect();
        let px = f64::from(PX_PER_POINT);
        let chosen = choose_labels(&labels, px);
        assert_eq!(chosen.first(), Some(&0), "embd");
        assert_eq!(chosen.last(), Some(&(labels.len() - 1)), "out");
        for w in chosen.windows(2) {
            let gap = (w[1] - w[0]) as f64 * px;
            let need =
                (text_width(labels[w[0]], LABEL_PX) + text_width(labels[w[1]], LABEL_PX)) / 2.0;
            assert!(gap >= need, "{} and {} overlap", labels[w[0]], labels[w[1]]);
        }
        // Few points: every label fits.
        let few = ["embd", "0", "1", "2", "out"];
        assert_eq!(choose_labels(&few, 100.0), vec![0, 1, 2, 3, 4]);
    }

    #[test]
    fn write_svg_writes_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("plot.svg");
        write_svg(&model(3), &path).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        check_xml(&svg);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }
}
