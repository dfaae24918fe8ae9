//! `strftime_now`: the clock a template reads (the system's, or one pinned for reproducible
//! renderings) and Python's `datetime.strftime`, written out here because a template's date
//! line must match transformers' output without a time-zone database or a time crate.

use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use super::SYSTEM_CLOCK;

pub(super) fn now_micros(clock: &AtomicI64) -> i64 {
    match clock.load(Ordering::Relaxed) {
        SYSTEM_CLOCK => match SystemTime::now().duration_since(UNIX_EPOCH) {
            Ok(d) => d.as_micros() as i64,
            Err(e) => -(e.duration().as_micros() as i64),
        },
        pinned => pinned,
    }
}

/// A UTC calendar date and time. transformers' `strftime_now` formats `datetime.now()`, the
/// machine's local time; this is UTC, which is the same wherever the zone is UTC (containers,
/// CI, the GPU machines) and costs no time-zone database or time crate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct CivilTime {
    year: i64,
    /// 1..=12
    month: u32,
    /// 1..=31
    day: u32,
    hour: u32,
    minute: u32,
    second: u32,
    micros: u32,
    /// 0 = Sunday … 6 = Saturday
    weekday: u32,
    /// 0-based day of the year
    yday: u32,
    unix_seconds: i64,
}

impl CivilTime {
    pub(super) fn from_unix_micros(us: i64) -> Self {
        let secs = us.div_euclid(1_000_000);
        let days = secs.div_euclid(86_400);
        let sod = secs.rem_euclid(86_400) as u32;
        let (year, month, day) = civil_from_days(days);
        CivilTime {
            year,
            month,
            day,
            hour: sod / 3600,
            minute: sod / 60 % 60,
            second: sod % 60,
            micros: us.rem_euclid(1_000_000) as u32,
            // 1970-01-01 was a Thursday.
            weekday: (days + 4).rem_euclid(7) as u32,
            yday: (days - days_from_civil(year, 1, 1)) as u32,
            unix_seconds: secs,
        }
    }
}

// Howard Hinnant's proleptic-Gregorian day-count conversions (days since 1970-01-01).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

fn days_from_civil(year: i64, month: u32, day: u32) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = i64::from((month + 9) % 12);
    let doy = (153 * mp + 2) / 5 + i64::from(day) - 1;
    era * 146_097 + yoe * 365 + yoe / 4 - yoe / 100 + doy - 719_468
}

const DAYS: [&str; 7] = [
    "Sunday",
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
];
const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];

/// Python's `datetime.strftime` on Linux for a naive datetime: Python's own `%f`, `%z`, `%Z`
/// (empty: `datetime.now()` has no zone) and glibc's C-locale conversions with its `-`, `_`,
/// `0`, `^` flags and field widths. An unknown conversion is copied as written, as glibc does.
pub(super) fn strftime(format: &str, t: &CivilTime) -> String {
    let mut out = String::new();
    let mut chars = format.char_indices().peekable();
    while let Some((start, c)) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let mut flag = None;
        if let Some(&(_, f @ ('-' | '_' | '0' | '^' | '#'))) = chars.peek() {
            flag = Some(f);
            chars.next();
        }
        let mut width = None;
        while let Some(&(_, d @ '0'..='9')) = chars.peek() {
            width = Some(width.unwrap_or(0) * 10 + d.to_digit(10).unwrap() as usize);
            chars.next();
        }
        let Some((end, conv)) = chars.next() else {
            out.push_str(&format[start..]);
            break;
        };
        let spec = Spec { flag, width };
        let (hour12, pm) = (
            if t.hour % 12 == 0 { 12 } else { t.hour % 12 },
            t.hour >= 12,
        );
        let text = match conv {
            'a' => spec.text(&DAYS[t.weekday as usize][..3]),
            'A' => spec.text(DAYS[t.weekday as usize]),
            'b' | 'h' => spec.text(&MONTHS[t.month as usize - 1][..3]),
            'B' => spec.text(MONTHS[t.month as usize - 1]),
            'p' => spec.text(if pm { "PM" } else { "AM" }),
            'P' => spec.text(if pm { "pm" } else { "am" }),
            'c' => strftime("%a %b %e %H:%M:%S %Y", t),
            'D' | 'x' => strftime("%m/%d/%y", t),
            'F' => strftime("%Y-%m-%d", t),
            'r' => strftime("%I:%M:%S %p", t),
            'R' => strftime("%H:%M", t),
            'T' | 'X' => strftime("%H:%M:%S", t),
            'd' => spec.num(t.day.into(), 2, '0'),
            'e' => spec.num(t.day.into(), 2, ' '),
            'm' => spec.num(t.month.into(), 2, '0'),
            'y' => spec.num(t.year.rem_euclid(100), 2, '0'),
            'Y' => spec.num(t.year, 1, '0'),
            'C' => spec.num(t.year.div_euclid(100), 2, '0'),
            'H' => spec.num(t.hour.into(), 2, '0'),
            'k' => spec.num(t.hour.into(), 2, ' '),
            'I' => spec.num(hour12.into(), 2, '0'),
            'l' => spec.num(hour12.into(), 2, ' '),
            'M' => spec.num(t.minute.into(), 2, '0'),
            'S' => spec.num(t.second.into(), 2, '0'),
            'f' => format!("{:06}", t.micros),
            'j' => spec.num(i64::from(t.yday) + 1, 3, '0'),
            'u' => spec.num(if t.weekday == 0 { 7 } else { t.weekday.into() }, 1, '0'),
            'w' => spec.num(t.weekday.into(), 1, '0'),
            'U' => spec.num(i64::from((t.yday + 7 - t.weekday) / 7), 2, '0'),
            'W' => spec.num(i64::from((t.yday + 7 - (t.weekday + 6) % 7) / 7), 2, '0'),
            'G' => spec.num(iso_week(t).0, 1, '0'),
            'g' => spec.num(iso_week(t).0.rem_euclid(100), 2, '0'),
            'V' => spec.num(iso_week(t).1, 2, '0'),
            's' => t.unix_seconds.to_string(),
            'n' => "\n".into(),
            't' => "\t".into(),
            '%' => "%".into(),
            'z' | 'Z' => String::new(),
            _ => format[start..end + conv.len_utf8()].to_string(),
        };
        out.push_str(&text);
    }
    out
}

struct Spec {
    flag: Option<char>,
    width: Option<usize>,
}

impl Spec {
    fn num(&self, v: i64, default_width: usize, default_pad: char) -> String {
        let pad = match self.flag {
            Some('-') => return v.to_string(),
            Some('_') => ' ',
            Some('0') => '0',
            _ => default_pad,
        };
        let width = self.width.unwrap_or(default_width);
        let digits = v.unsigned_abs().to_string();
        let sign = if v < 0 { "-" } else { "" };
        let fill = width.saturating_sub(digits.len() + sign.len());
        if pad == '0' {
            format!("{sign}{}{digits}", "0".repeat(fill))
        } else {
            format!("{}{sign}{digits}", " ".repeat(fill))
        }
    }

    fn text(&self, s: &str) -> String {
        let s = if self.flag == Some('^') {
            s.to_uppercase()
        } else {
            s.to_string()
        };
        let fill = self.width.unwrap_or(0).saturating_sub(s.chars().count());
        format!("{}{s}", " ".repeat(fill))
    }
}

/// ISO 8601 (year, week): weeks start on Monday and week 1 holds the year's first Thursday.
fn iso_week(t: &CivilTime) -> (i64, i64) {
    let monday_based = i64::from((t.weekday + 6) % 7) + 1;
    let week = (i64::from(t.yday) + 1 - monday_based + 10) / 7;
    if week < 1 {
        (t.year - 1, iso_weeks_in_year(t.year - 1))
    } else if week > iso_weeks_in_year(t.year) {
        (t.year + 1, 1)
    } else {
        (t.year, week)
    }
}

fn iso_weeks_in_year(year: i64) -> i64 {
    let p = |y: i64| (y + y.div_euclid(4) - y.div_euclid(100) + y.div_euclid(400)).rem_euclid(7);
    if p(year) == 4 || p(year - 1) == 3 {
        53
    } else {
        52
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(unix: i64) -> CivilTime {
        CivilTime::from_unix_micros(unix * 1_000_000)
    }

    #[test]
    fn civil_dates_round_trip_and_known_days() {
        let t = at(0);
        assert_eq!(
            (t.year, t.month, t.day, t.weekday, t.yday),
            (1970, 1, 1, 4, 0)
        );
        let t = at(951_782_400); // 2000-02-29, a Tuesday
        assert_eq!(
            (t.year, t.month, t.day, t.weekday, t.yday),
            (2000, 2, 29, 2, 59)
        );
        let t = at(-1); // 1969-12-31 23:59:59, a Wednesday
        assert_eq!(
            (t.year, t.month, t.day, t.hour, t.minute, t.second, t.weekday),
            (1969, 12, 31, 23, 59, 59, 3)
        );
        for days in (-800_000..800_000).step_by(997) {
            let (y, m, d) = civil_from_days(days);
            assert_eq!(days_from_civil(y, m, d), days);
        }
    }

    #[test]
    fn strftime_matches_python_on_linux() {
        let t = at(1_721_952_000 + 13 * 3600 + 5 * 60 + 9); // Fri 2024-07-26 13:05:09
        let cases = [
            ("%d %b %Y", "26 Jul 2024"),
            ("%d %B %Y", "26 July 2024"),
            ("%A %a %j %p %I", "Friday Fri 208 PM 01"),
            ("%H:%M:%S %m/%y", "13:05:09 07/24"),
            (
                "%Y-%m-%d %e|%-d|%_m|%^b|%10A|",
                "2024-07-26 26|26| 7|JUL|    Friday|",
            ),
            ("%c", "Fri Jul 26 13:05:09 2024"),
            ("%F %T %D %R", "2024-07-26 13:05:09 07/26/24 13:05"),
            ("%u %w %U %W %V %G %g", "5 5 29 30 30 2024 24"),
            ("%s %f [%z%Z] %% %Q %", "1721999109 000000 [] % %Q %"),
        ];
        for (fmt, want) in cases {
            assert_eq!(strftime(fmt, &t), want, "{fmt}");
        }
        let t = at(1_104_537_600); // Sat 2005-01-01 belongs to ISO week 53 of 2004
        assert_eq!(strftime("%G-W%V-%u %j %l%P", &t), "2004-W53-6 001 12am");
        let t = at(1_230_681_600); // Wed 2008-12-31 is in ISO week 1 of 2009
        assert_eq!(strftime("%G %V", &t), "2009 01");
    }
}
