//! The rolling-update chart: hit rate and p90 time to first token per window, over time, for the
//! run with peer bootstrap and the run without, drawn to a PNG with `plotters`.
//!
//! Text is drawn with a TrueType font read at run time (`--chart-font`) through plotters'
//! `ab_glyph` backend, so building the demo needs no system font library (fontconfig), and a
//! machine without the font fails the chart with a message naming the path instead of drawing
//! a chart without labels.

use std::path::Path;

use plotters::prelude::*;

/// One run as the chart draws it (built by `crate::rolling`, which owns the measurement; this
/// module only draws, so it depends on nothing of the demo).
#[derive(Debug, Clone)]
pub struct ChartRun {
    /// With peer bootstrap (blue) or without (red).
    pub bootstrap: bool,
    /// Per window: (start, seconds; hit rate, percent; p90 TTFT, ms).
    pub windows: Vec<(f64, f64, f64)>,
    /// When each new replica joined the rotation, seconds.
    pub joins_s: Vec<f64>,
    pub steady_hit_pct: f64,
    pub min_hit_pct: f64,
    pub steady_ttft_p90_ms: f64,
    pub max_ttft_p90_ms: f64,
    pub wall_s: f64,
}

/// The font `--chart-font` defaults to (Debian's fonts-dejavu-core).
pub const DEFAULT_CHART_FONT: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";
/// Canvas size in pixels (two stacked panels).
const CHART_WIDTH_PX: u32 = 1200;
const CHART_HEIGHT_PX: u32 = 820;
/// Largest font file read (DejaVu Sans is ~750 KB).
const CHART_FONT_MAX_BYTES: u64 = 32 * 1024 * 1024;

const BOOTSTRAP_COLOUR: RGBColor = RGBColor(31, 119, 180);
const COLD_COLOUR: RGBColor = RGBColor(214, 39, 40);

fn colour(bootstrap: bool) -> RGBColor {
    if bootstrap {
        BOOTSTRAP_COLOUR
    } else {
        COLD_COLOUR
    }
}

fn legend(bootstrap: bool) -> &'static str {
    if bootstrap {
        "with peer bootstrap"
    } else {
        "bootstrap off (cold replicas)"
    }
}

fn register_font(path: &Path) -> Result<(), String> {
    let len = std::fs::metadata(path)
        .map_err(|e| format!("chart font {}: {e} (set --chart-font)", path.display()))?
        .len();
    if len > CHART_FONT_MAX_BYTES {
        return Err(format!(
            "chart font {}: {len} bytes, over {CHART_FONT_MAX_BYTES}",
            path.display()
        ));
    }
    let bytes = std::fs::read(path)
        .map_err(|e| format!("chart font {}: {e} (set --chart-font)", path.display()))?;
    // plotters keeps registered fonts for the process's lifetime and wants them 'static; the
    // demo draws one chart per run, so leaking one font file is the whole cost.
    let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
    plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
        .map_err(|_| format!("chart font {}: not a TrueType font", path.display()))
}

/// Draws both runs into `out` (creating its directory).
pub fn draw_rolling_update(out: &Path, font: &Path, runs: &[ChartRun]) -> Result<(), String> {
    register_font(font)?;
    if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    }
    draw(out, runs).map_err(|e| format!("drawing {}: {e}", out.display()))
}

fn draw(out: &Path, runs: &[ChartRun]) -> Result<(), Box<dyn std::error::Error>> {
    let root = BitMapBackend::new(out, (CHART_WIDTH_PX, CHART_HEIGHT_PX)).into_drawing_area();
    root.fill(&WHITE)?;
    let (top, bottom) = root.split_vertically(CHART_HEIGHT_PX / 2);
    let x_max = runs.iter().map(|r| r.wall_s).fold(1.0_f64, f64::max).ceil();

    let hit_floor = runs
        .iter()
        .flat_map(|r| r.windows.iter().map(|w| w.1))
        .fold(100.0_f64, f64::min);
    let hit_min = ((hit_floor - 5.0) / 10.0).floor().max(0.0) * 10.0;
    let mut hit = ChartBuilder::on(&top)
        .caption(
            format!(
                "Rolling update of {} router replicas: cache hit rate per window",
                runs.iter().map(|r| r.joins_s.len()).max().unwrap_or(0)
            ),
            ("sans-serif", 22),
        )
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(56)
        .build_cartesian_2d(0.0..x_max, hit_min..100.0)?;
    hit.configure_mesh()
        .x_desc("seconds since traffic started")
        .y_desc("hit rate (%)")
        .label_style(("sans-serif", 14))
        .draw()?;
    for r in runs {
        let c = colour(r.bootstrap);
        draw_markers(&mut hit, r, c, hit_min, 100.0)?;
        hit.draw_series(LineSeries::new(
            r.windows.iter().map(|w| (w.0, w.1)),
            c.stroke_width(2),
        ))?
        .label(format!(
            "{} (steady {:.1}%, lowest window {:.1}%)",
            legend(r.bootstrap),
            r.steady_hit_pct,
            r.min_hit_pct
        ))
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
    }
    hit.configure_series_labels()
        .position(SeriesLabelPosition::LowerLeft)
        .label_font(("sans-serif", 15))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()?;

    let ttft_max = runs
        .iter()
        .flat_map(|r| r.windows.iter().map(|w| w.2))
        .fold(1.0_f64, f64::max)
        * 1.1;
    let mut ttft = ChartBuilder::on(&bottom)
        .caption(
            "p90 time to first token per window (vertical lines: a new replica joins)",
            ("sans-serif", 22),
        )
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(56)
        .build_cartesian_2d(0.0..x_max, 0.0..ttft_max)?;
    ttft.configure_mesh()
        .x_desc("seconds since traffic started")
        .y_desc("p90 TTFT (ms)")
        .label_style(("sans-serif", 14))
        .draw()?;
    for r in runs {
        let c = colour(r.bootstrap);
        draw_markers(&mut ttft, r, c, 0.0, ttft_max)?;
        ttft.draw_series(LineSeries::new(
            r.windows.iter().map(|w| (w.0, w.2)),
            c.stroke_width(2),
        ))?
        .label(format!(
            "{} (steady {:.0} ms, worst window {:.0} ms)",
            legend(r.bootstrap),
            r.steady_ttft_p90_ms,
            r.max_ttft_p90_ms
        ))
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
    }
    ttft.configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .label_font(("sans-serif", 15))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}

type Panel<'a, 'b> = ChartContext<
    'a,
    BitMapBackend<'b>,
    Cartesian2d<plotters::coord::types::RangedCoordf64, plotters::coord::types::RangedCoordf64>,
>;

/// A thin vertical line where each new replica joined the rotation.
fn draw_markers(
    panel: &mut Panel<'_, '_>,
    run: &ChartRun,
    c: RGBColor,
    y_min: f64,
    y_max: f64,
) -> Result<(), Box<dyn std::error::Error>> {
    panel.draw_series(
        run.joins_s
            .iter()
            .map(|&x| PathElement::new(vec![(x, y_min), (x, y_max)], c.mix(0.6).stroke_width(2))),
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(bootstrap: bool, hit_pct: f64) -> ChartRun {
        ChartRun {
            bootstrap,
            windows: (0..10)
                .map(|i| (f64::from(i), hit_pct, 40.0 + f64::from(i)))
                .collect(),
            joins_s: vec![4.1],
            steady_hit_pct: hit_pct,
            min_hit_pct: hit_pct,
            steady_ttft_p90_ms: 41.0,
            max_ttft_p90_ms: 49.0,
            wall_s: 10.0,
        }
    }

    #[test]
    fn chart_is_a_png_or_an_error_naming_the_missing_font() {
        let dir = std::env::temp_dir().join(format!("kvroute-chart-{}", std::process::id()));
        let out = dir.join("nested").join("chart.png");
        let runs = [run(true, 90.0), run(false, 70.0)];
        let missing = Path::new("/nonexistent/kvroute-test-font.ttf");
        let err = draw_rolling_update(&out, missing, &runs).expect_err("no font, no chart");
        assert!(err.contains("/nonexistent/kvroute-test-font.ttf"), "{err}");
        let font = Path::new(DEFAULT_CHART_FONT);
        if font.exists() {
            draw_rolling_update(&out, font, &runs).expect("chart drawn");
            let png = std::fs::read(&out).expect("chart written");
            assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n", "not a PNG");
            assert!(
                png.len() > 10_000,
                "a {}-byte PNG has no content",
                png.len()
            );
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
