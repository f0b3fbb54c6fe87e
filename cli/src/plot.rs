//! Line charts as SVG or PNG: the one place the project draws plots
//! (benchmarks, IO accounting, the precision study), on the `plotters` crate.
//!
//! Text needs a font even in SVG, because plotters sizes labels with real
//! glyph metrics. We embed a 15 KB ASCII subset of DejaVu Sans
//! (`assets/fonts/`, license next to it) and register it from bytes through
//! plotters' pure-Rust `ab_glyph` feature, rather than looking up system
//! fonts: a fresh Debian machine or container often has none, and the `ttf`
//! feature would need fontconfig/freetype at build time. If the font still
//! cannot be registered, rendering returns [`PlotError::Font`] instead of
//! letting plotters panic on the first label.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use plotters::coord::ranged1d::{AsRangedCoord, ValueFormatter};
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

/// Why a chart could not be rendered.
#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    #[error("plot file {} must end in .svg or .png", path.display())]
    Format { path: PathBuf },
    #[error("chart \"{title}\" has no points to plot")]
    Empty { title: String },
    #[error("series \"{series}\" of chart \"{title}\" has {axis} = {value} at point ({x}, {y}); values must be {need}")]
    BadValue {
        title: String,
        series: String,
        axis: &'static str,
        value: f64,
        x: f64,
        y: f64,
        need: &'static str,
    },
    #[error("chart text needs a font: {reason}")]
    Font { reason: String },
    #[error("cannot draw chart \"{title}\": {reason}")]
    Draw { title: String, reason: String },
    #[error("cannot move {} to {}", from.display(), to.display())]
    Write {
        from: PathBuf,
        to: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

type Result<T, E = PlotError> = std::result::Result<T, E>;

/// One named line of `(x, y)` points, drawn in the order given.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

impl Series {
    pub fn new(name: impl Into<String>, points: Vec<(f64, f64)>) -> Self {
        Self {
            name: name.into(),
            points,
        }
    }
}

/// A chart: title, axis labels, linear or logarithmic axes, some series.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Chart {
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    pub log_x: bool,
    pub log_y: bool,
    pub series: Vec<Series>,
}

/// Size of every rendered chart, in pixels (SVG user units).
pub const SIZE: (u32, u32) = (1100, 620);

const FONT: &[u8] = include_bytes!("../assets/fonts/DejaVuSans-subset.ttf");

/// Okabe–Ito colorblind-safe colors (gray instead of its pale yellow); markers cycle separately so that two
/// series never share both color and marker within 8 × 5 series.
const COLORS: [RGBColor; 8] = [
    RGBColor(0, 114, 178),
    RGBColor(213, 94, 0),
    RGBColor(0, 158, 115),
    RGBColor(204, 121, 167),
    RGBColor(86, 180, 233),
    RGBColor(230, 159, 0),
    RGBColor(0, 0, 0),
    RGBColor(120, 120, 120),
];
const MARKERS: usize = 5;
/// Length of the line sample in front of each legend entry, in pixels.
const LEGEND_KEY: u32 = 28;

/// Render `chart` to `path`: SVG or PNG chosen by the extension.
///
/// Any other extension, a chart without points, or a non-finite value (or a
/// non-positive one on a log axis) is a [`PlotError`] naming the
/// problem. The image is written to a temporary file in the same directory
/// and renamed into place, so `path` is never left half-written.
pub fn render(chart: &Chart, path: &Path) -> Result<()> {
    let format = Format::of(path)?;
    let (x_range, y_range) = validate(chart)?;
    register_font()?;
    let tmp = temp_path(path, format);
    let drawn = draw_to(chart, &tmp, format, x_range, y_range);
    let written = drawn.and_then(|()| {
        std::fs::rename(&tmp, path).map_err(|source| PlotError::Write {
            from: tmp.clone(),
            to: path.to_path_buf(),
            source,
        })
    });
    if written.is_err() {
        // Drawing can fail after the temporary file was created.
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Format {
    Svg,
    Png,
}

impl Format {
    fn of(path: &Path) -> Result<Self> {
        let ext = path
            .extension()
            .and_then(|e| e.to_str())
            .map(str::to_ascii_lowercase);
        match ext.as_deref() {
            Some("svg") => Ok(Self::Svg),
            Some("png") => Ok(Self::Png),
            _ => Err(PlotError::Format {
                path: path.to_path_buf(),
            }),
        }
    }

    fn ext(self) -> &'static str {
        match self {
            Self::Svg => "svg",
            Self::Png => "png",
        }
    }
}

/// Checks the data and returns the padded x and y ranges to draw.
fn validate(chart: &Chart) -> Result<(Range<f64>, Range<f64>)> {
    let points = || chart.series.iter().flat_map(|s| s.points.iter());
    if points().next().is_none() {
        return Err(PlotError::Empty {
            title: chart.title.clone(),
        });
    }
    for s in &chart.series {
        for &(x, y) in &s.points {
            for (v, axis, log) in [(x, "x", chart.log_x), (y, "y", chart.log_y)] {
                if !v.is_finite() || (log && v <= 0.0) {
                    let need = if log {
                        "finite and > 0 on a log axis"
                    } else {
                        "finite"
                    };
                    return Err(PlotError::BadValue {
                        title: chart.title.clone(),
                        series: s.name.clone(),
                        axis,
                        value: v,
                        x,
                        y,
                        need,
                    });
                }
            }
        }
    }
    let span = |vals: &mut dyn Iterator<Item = f64>, log: bool| {
        let (lo, hi) = vals.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
            (lo.min(v), hi.max(v))
        });
        if log {
            log_range(lo, hi)
        } else {
            linear_range(lo, hi)
        }
    };
    let x = span(&mut points().map(|p| p.0), chart.log_x);
    let y = span(&mut points().map(|p| p.1), chart.log_y);
    Ok((x, y))
}

fn linear_range(lo: f64, hi: f64) -> Range<f64> {
    let pad = if hi > lo {
        0.05 * (hi - lo)
    } else {
        0.1 * lo.abs().max(1.0)
    };
    lo - pad..hi + pad
}

/// Pads by 10% in log space, but widens to whole decades when that would
/// leave fewer than two powers of ten: plotters labels a log axis only at
/// powers of ten and their multiples, so a narrow range would have no ticks.
fn log_range(lo: f64, hi: f64) -> Range<f64> {
    let (l, h) = (lo.log10(), hi.log10());
    let pad = 0.1 * (h - l).max(0.3);
    let (l, h) = (l - pad, h + pad);
    if h.floor() - l.ceil() >= 1.0 {
        10f64.powf(l)..10f64.powf(h)
    } else {
        10f64.powf(l.floor())..10f64.powf(h.ceil())
    }
}

fn register_font() -> Result<()> {
    static REGISTERED: OnceLock<Result<(), String>> = OnceLock::new();
    REGISTERED
        .get_or_init(|| {
            plotters::style::register_font("sans-serif", FontStyle::Normal, FONT)
                .map_err(|_| "the embedded DejaVu Sans subset is not a valid font".to_string())
        })
        .clone()
        .map_err(|reason| PlotError::Font { reason })
}

/// `.NAME.tmpPID-N.EXT` next to `path`: same filesystem, so the rename is
/// atomic; hidden, so a crash leaves no file that looks like a chart.
fn temp_path(path: &Path, format: Format) -> PathBuf {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    path.with_file_name(format!(
        ".{name}.tmp{}-{n}.{}",
        std::process::id(),
        format.ext()
    ))
}

fn draw_to(chart: &Chart, tmp: &Path, format: Format, x: Range<f64>, y: Range<f64>) -> Result<()> {
    let fail = |reason: String| PlotError::Draw {
        title: chart.title.clone(),
        reason,
    };
    // plotters asserts on some degenerate geometry; validation should rule
    // that out, and this turns anything it missed into an error, not a crash.
    let run = || -> std::result::Result<(), String> {
        match format {
            Format::Svg => {
                let mut svg = String::new();
                {
                    let root = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
                    draw_axes(&root, chart, x, y)?;
                }
                std::fs::write(tmp, svg).map_err(|e| format!("{}: {e}", tmp.display()))
            }
            Format::Png => {
                let mut rgb = vec![0u8; SIZE.0 as usize * SIZE.1 as usize * 3];
                {
                    let root = BitMapBackend::with_buffer(&mut rgb, SIZE).into_drawing_area();
                    draw_axes(&root, chart, x, y)?;
                }
                write_png(tmp, &rgb).map_err(|e| format!("{}: {e}", tmp.display()))
            }
        }
    };
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(run)) {
        Ok(r) => r.map_err(fail),
        Err(_) => Err(fail("the plotting library panicked".into())),
    }
}

/// Encodes an RGB buffer of [`SIZE`] with the `png` crate directly, rather
/// than plotters' `bitmap_encoder`, which pulls in the whole `image` crate
/// (JPEG and BMP codecs included) for this one call.
fn write_png(path: &Path, rgb: &[u8]) -> std::result::Result<(), String> {
    let file = std::fs::File::create(path).map_err(|e| e.to_string())?;
    let mut encoder = png::Encoder::new(std::io::BufWriter::new(file), SIZE.0, SIZE.1);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    let mut writer = encoder.write_header().map_err(|e| e.to_string())?;
    writer.write_image_data(rgb).map_err(|e| e.to_string())?;
    writer.finish().map_err(|e| e.to_string())
}

/// Picks the coordinate types (2 × 2 combinations of linear and log).
fn draw_axes<DB: DrawingBackend>(
    root: &DrawingArea<DB, plotters::coord::Shift>,
    chart: &Chart,
    x: Range<f64>,
    y: Range<f64>,
) -> std::result::Result<(), String> {
    let xf = tick_formatter(&x, chart.log_x);
    let yf = tick_formatter(&y, chart.log_y);
    match (chart.log_x, chart.log_y) {
        (false, false) => draw_chart(root, chart, x, y, &xf, &yf),
        (true, false) => draw_chart(root, chart, x.log_scale(), y, &xf, &yf),
        (false, true) => draw_chart(root, chart, x, y.log_scale(), &xf, &yf),
        (true, true) => draw_chart(root, chart, x.log_scale(), y.log_scale(), &xf, &yf),
    }
}

type Formatter = Box<dyn Fn(&f64) -> String>;

fn draw_chart<DB, X, Y>(
    root: &DrawingArea<DB, plotters::coord::Shift>,
    chart: &Chart,
    x: X,
    y: Y,
    x_fmt: &Formatter,
    y_fmt: &Formatter,
) -> std::result::Result<(), String>
where
    DB: DrawingBackend,
    X: AsRangedCoord<Value = f64>,
    Y: AsRangedCoord<Value = f64>,
    X::CoordDescType: ValueFormatter<f64>,
    Y::CoordDescType: ValueFormatter<f64>,
{
    let e = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
    root.fill(&WHITE).map_err(e)?;
    // The legend gets its own panel right of the chart: inside the plotting
    // area it would hide data whichever corner it took.
    let label_style = ("sans-serif", 15).into_font().color(&BLACK);
    let mut text_w = 0;
    for s in &chart.series {
        text_w = text_w.max(root.estimate_text_size(&s.name, &label_style).map_err(e)?.0);
    }
    let width = root.dim_in_pixel().0;
    let legend_w = (text_w + LEGEND_KEY + 30).min(width * 2 / 5);
    let (plot_area, legend_area) = root.split_horizontally(width - legend_w);
    let mut ctx = ChartBuilder::on(&plot_area)
        .caption(&chart.title, ("sans-serif", 24))
        .margin(20)
        .x_label_area_size(50)
        .y_label_area_size(80)
        .build_cartesian_2d(x, y)
        .map_err(e)?;
    ctx.configure_mesh()
        .x_desc(chart.x_label.as_str())
        .y_desc(chart.y_label.as_str())
        .axis_desc_style(("sans-serif", 18))
        .label_style(("sans-serif", 15))
        .x_label_formatter(x_fmt)
        .y_label_formatter(y_fmt)
        .light_line_style(BLACK.mix(0.05))
        .bold_line_style(BLACK.mix(0.15))
        .draw()
        .map_err(e)?;
    let top = ctx.plotting_area().get_pixel_range().1.start + 10;
    for (i, s) in chart.series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let line = color.stroke_width(2);
        ctx.draw_series(LineSeries::new(s.points.iter().copied(), line))
            .map_err(e)?;
        ctx.draw_series(
            s.points
                .iter()
                .map(|&p| EmptyElement::at(p) + marker(i, color, (0, 0))),
        )
        .map_err(e)?;
        let y = top + 26 * i as i32;
        let key = EmptyElement::at((5, y))
            + PathElement::new(vec![(0, 0), (LEGEND_KEY as i32, 0)], line)
            + marker(i, color, (LEGEND_KEY as i32 / 2, 0));
        legend_area.draw(&key).map_err(e)?;
        let text = Text::new(
            s.name.as_str(),
            (LEGEND_KEY as i32 + 12, y),
            label_style.pos(Pos::new(HPos::Left, VPos::Center)),
        );
        legend_area.draw(&text).map_err(e)?;
    }
    root.present().map_err(e)
}

/// The marker of series `i`: a filled polygon in pixels around `(cx, cy)`
/// (circle, square, triangle, diamond, inverted triangle), so every shape
/// has one element type.
fn marker(i: usize, color: RGBColor, (cx, cy): (i32, i32)) -> Polygon<(i32, i32)> {
    let ring = |n: usize, r: f64, turn: f64| -> Vec<(i32, i32)> {
        (0..n)
            .map(|k| {
                let a = std::f64::consts::TAU * (k as f64 / n as f64 + turn);
                (
                    cx + (r * a.cos()).round() as i32,
                    cy + (r * a.sin()).round() as i32,
                )
            })
            .collect()
    };
    let points = match i % MARKERS {
        0 => ring(16, 4.5, 0.0),
        1 => ring(4, 5.5, 0.125),
        2 => ring(3, 6.0, -0.25),
        3 => ring(4, 6.0, 0.0),
        _ => ring(3, 6.0, 0.25),
    };
    Polygon::new(points, color.filled())
}

/// Tick labels: plain decimals with only the digits the axis needs; on a
/// log axis spanning beyond [1e-3, 1e5], powers of ten as `10⁻⁶` and other
/// ticks as `2×10⁻⁶`.
fn tick_formatter(range: &Range<f64>, log: bool) -> Formatter {
    if log && (range.start < 1e-3 || range.end > 1e5) {
        return Box::new(|&v: &f64| {
            let e = v.log10().floor();
            let m = v / 10f64.powf(e);
            let (m, e) = if m >= 9.995 { (1.0, e + 1.0) } else { (m, e) };
            let pow = format!("10{}", superscript(e as i64));
            if (m - 1.0).abs() < 0.005 {
                pow
            } else {
                format!("{}×{pow}", trim(format!("{m:.2}")))
            }
        });
    }
    let step = if log {
        range.start
    } else {
        (range.end - range.start) / 10.0
    };
    let digits = (-step.abs().log10().floor()).clamp(0.0, 12.0) as usize;
    Box::new(move |&v: &f64| trim(format!("{v:.digits$}")))
}

fn trim(s: String) -> String {
    if s.contains('.') {
        let t = s.trim_end_matches('0').trim_end_matches('.');
        if t == "-0" {
            "0".into()
        } else {
            t.into()
        }
    } else {
        s
    }
}

fn superscript(n: i64) -> String {
    const DIGITS: [char; 10] = ['⁰', '¹', '²', '³', '⁴', '⁵', '⁶', '⁷', '⁸', '⁹'];
    let digits = n.unsigned_abs().to_string();
    let mut s = String::from(if n < 0 { "⁻" } else { "" });
    s.extend(digits.bytes().map(|b| DIGITS[usize::from(b - b'0')]));
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chart(log: bool) -> Chart {
        Chart {
            title: "Time vs N".into(),
            x_label: "sequence length N".into(),
            y_label: "kernel time (ms)".into(),
            log_x: log,
            log_y: log,
            series: vec![
                Series::new("flash", vec![(256.0, 0.05), (1024.0, 0.4), (4096.0, 6.0)]),
                Series::new("naive", vec![(256.0, 0.08), (1024.0, 1.1), (4096.0, 21.0)]),
            ],
        }
    }

    #[test]
    fn svg_has_title_labels_and_series_names() {
        let dir = tempfile::tempdir().unwrap();
        for log in [false, true] {
            let path = dir.path().join(format!("chart-{log}.svg"));
            render(&chart(log), &path).unwrap();
            let svg = std::fs::read_to_string(&path).unwrap();
            assert!(svg.starts_with("<svg"), "{}", &svg[..40.min(svg.len())]);
            for text in [
                "Time vs N",
                "sequence length N",
                "kernel time (ms)",
                "flash",
                "naive",
            ] {
                assert!(svg.contains(text), "log = {log}: {text:?} missing");
            }
        }
        assert_eq!(
            crate::outputs::names(dir.path()),
            ["chart-false.svg", "chart-true.svg"]
        );
    }

    #[test]
    fn png_is_a_png() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("chart.PNG");
        render(&chart(true), &path).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
        assert!(
            bytes.len() > 5_000,
            "a {} byte PNG has no chart in it",
            bytes.len()
        );
        assert_eq!(crate::outputs::names(dir.path()), ["chart.PNG"]);
    }

    #[test]
    fn bad_charts_are_errors_and_leave_no_file() {
        let dir = tempfile::tempdir().unwrap();
        let svg = dir.path().join("c.svg");
        let jpg = dir.path().join("c.jpg");
        assert!(
            matches!(render(&chart(false), &jpg), Err(PlotError::Format { path }) if path == jpg)
        );
        let bare = dir.path().join("c");
        assert!(matches!(
            render(&chart(false), &bare),
            Err(PlotError::Format { .. })
        ));
        let mut empty = chart(false);
        empty.series.iter_mut().for_each(|s| s.points.clear());
        assert!(matches!(render(&empty, &svg), Err(PlotError::Empty { .. })));
        assert!(matches!(
            render(&Chart::default(), &svg),
            Err(PlotError::Empty { .. })
        ));
        let mut zero = chart(true);
        zero.series[1].points[0].1 = 0.0;
        match render(&zero, &svg) {
            Err(PlotError::BadValue {
                series,
                axis: "y",
                value,
                need,
                ..
            }) => assert!(series.contains("naive") && value == 0.0 && need.contains("log axis")),
            other => panic!("expected a bad value, got {other:?}"),
        }
        let mut nan = chart(false);
        nan.series[0].points[2].0 = f64::NAN;
        let png = dir.path().join("c.png");
        assert!(matches!(
            render(&nan, &png),
            Err(PlotError::BadValue { axis: "x", .. })
        ));
        assert!(
            crate::outputs::names(dir.path()).is_empty(),
            "{:?}",
            crate::outputs::names(dir.path())
        );
        // A directory that does not exist: an I/O error, nothing written.
        let missing = dir.path().join("no/such/dir/c.svg");
        assert!(matches!(
            render(&chart(false), &missing),
            Err(PlotError::Draw { .. })
        ));
        assert!(crate::outputs::names(dir.path()).is_empty());
    }

    #[test]
    fn a_single_point_and_a_narrow_log_range_still_render() {
        let dir = tempfile::tempdir().unwrap();
        let one = Chart {
            series: vec![Series::new("one", vec![(3.0, 3.0)])],
            log_y: true,
            ..Chart::default()
        };
        render(&one, &dir.path().join("one.svg")).unwrap();
        let r = log_range(2e-4, 8e-4);
        assert!(r.start <= 1e-4 && r.end >= 1e-3, "{r:?}");
        let r = log_range(1.0, 1e6);
        assert!(r.start > 0.2 && r.end < 5e6, "{r:?}");
    }

    #[test]
    fn tick_labels() {
        let log = tick_formatter(&(1e-8..1.0), true);
        assert_eq!(log(&1e-6), "10⁻⁶");
        assert_eq!(log(&3e-5), "3×10⁻⁵");
        assert_eq!(log(&1.0), "10⁰");
        assert_eq!(log(&9.9999999e-3), "10⁻²");
        let small_log = tick_formatter(&(1.0..1000.0), true);
        assert_eq!(small_log(&100.0), "100");
        let lin = tick_formatter(&(0.0..0.05), false);
        assert_eq!(lin(&0.025), "0.025");
        assert_eq!(lin(&0.0), "0");
        let lin = tick_formatter(&(0.0..5000.0), false);
        assert_eq!(lin(&2500.0), "2500");
    }
}
